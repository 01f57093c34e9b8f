"""`undying eval CKPT_URL --data URL`: the validation loss of a committed checkpoint, in one process.

    undying eval CKPT_URL --data URL [--step N] [--windows K] [--seq-len T] [--json]
                 [--storage-option KEY=VALUE ...] [--storage-options-file PATH]

CKPT_URL is a job's checkpoint root (as for `undying ckpt`); --data a dataset prepared by
`undying data prepare`. The number is defined in trainer/evaluation.py: the first K
non-overlapping windows of T + 1 tokens from the dataset's start, summed token cross-entropy
over K * T tokens. T defaults to the sequence length the job trained with (the manifest
records it), K to 64. The model is rebuilt from the architecture the manifest carries and
loaded whole on this machine's CPU (or its GPU with --device cuda), and evaluated in fp32
(a bf16 job's in-training numbers, taken under autocast, differ by that rounding).

Exit codes: 0 printed; 1 the checkpoint is damaged; 2 the arguments cannot work (no such
checkpoint or dataset, too few windows, a vocabulary the model cannot read). Under --json, one
JSON object on stdout, errors too ({"error": ..., "exit": N}).
"""

from __future__ import annotations

import argparse
import json

from ckpt.storage_errors import DEFAULT_READ_RETRY_S
from ckpt.storage_options import explain
from orchestrator.cli.ckpt_catalog import check_read_retry_s, unknown_protocol
from orchestrator.cli.ckpt_cmd import (
    UsageError,
    committed_or_fail,
    deleted_meanwhile,
    error_reason,
    is_storage_error,
    open_catalog,
    step_or_fail,
)
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail_line
from orchestrator.cli.storage_args import add_storage_option_args, parse_storage_options
from trainer.urls import absolute_url


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="validation loss of a committed checkpoint on a prepared dataset")
    p.add_argument("url", metavar="CKPT_URL", help="the job's checkpoint root: <checkpoint.url>/<job name>")
    p.add_argument("--data", required=True, help="a prepared dataset (`undying data prepare --out`)")
    p.add_argument("--step", type=int, help="checkpoint to evaluate (default: the newest committed)")
    p.add_argument("--windows", type=int, default=64, help="windows to evaluate (default 64)")
    p.add_argument("--seq-len", type=int, help="tokens per window minus one (default: the job's training seq_len)")
    p.add_argument("--json", dest="as_json", action="store_true",
                   help="print one JSON object on stdout (errors too: {\"error\": ..., \"exit\": N})")
    p.add_argument("--device", default="cpu", help="torch device to evaluate on (default cpu)")
    p.add_argument("--read-retry-s", type=float, default=DEFAULT_READ_RETRY_S,
                   help="how long the data store's transient read failures may delay the evaluation, retried, "
                        "before it gives up naming the store (default %(default)g)")
    add_storage_option_args(p, "fsspec storage option for both URLs, e.g. endpoint_url=http://host:8333 (repeatable)")


def _model_of(catalog, step: int):
    """(model config, manifest) of committed `step`: its manifest only, so the arguments are checked
    against the model before its weights are read."""
    from ckpt.hf_export import model_config_of
    from ckpt.reader import UnsupportedManifest, read_manifest

    try:
        manifest = read_manifest(catalog, step)
        return model_config_of(manifest), manifest
    except (UnsupportedManifest, ValueError) as err:  # another undying's manifest; a model we cannot build
        raise UsageError(f"--step {step}: {err}") from None


def _load_model(catalog, step: int, cfg, manifest, device: str):
    from ckpt.reader import load_checkpoint
    from trainer.model import build_model

    names = [n for n in manifest.tensors if n.startswith("model/")]
    tensors, _ = load_checkpoint(catalog, step, names)
    model = build_model(cfg, seed=0, device=device)
    model.load_state_dict({n.removeprefix("model/"): t for n, t in tensors.items()}, strict=True)
    return model


def _loaded(catalog, step: int, cfg, manifest, device: str):
    """The model of checkpoint `step`; a step a running job's retention deleted since it was chosen is
    a UsageError saying so (its read fails like damage would)."""
    from ckpt.errors import CorruptCheckpoint

    try:
        return _load_model(catalog, step, cfg, manifest, device)
    except CorruptCheckpoint:
        if deleted_meanwhile(catalog, step):
            raise UsageError(f"--step {step}: deleted meanwhile (a running job's retention, or `undying ckpt gc`); "
                             "evaluate a step that is kept (`undying ckpt ls`)") from None
        raise


def _check_device(device: str) -> None:
    """`--device` names a device this machine has: checked before anything is read."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"--device {device!r}: not a torch device ({err}); use cpu or cuda") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: this machine has no CUDA device torch can use; use --device cpu")
    index = torch.device(device).index
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise UsageError(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: evaluation runs on cpu or cuda")


def _open_dataset(data: str, options: dict, read_retry_s: float):
    """The prepared dataset `--data` names, its reads retried as a rank's are (`--read-retry-s`: the
    client's own retries are off, trainer.tokens.reader); UsageError naming --data when it cannot be one."""
    import fsspec

    from ckpt.storage_errors import ReadRetry
    from trainer.tokens.format import NoManifest, TokenFormatError
    from trainer.tokens.reader import TokenDataset

    try:
        url = absolute_url(data)
    except ValueError as err:  # a URL mistyped into a relative path, or nothing
        raise UsageError(f"--data {err}") from None
    try:
        fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as err:  # an unknown protocol, or its package missing
        raise UsageError(unknown_protocol(f"--data {data}", err)) from None
    try:
        return TokenDataset(url, options, retry=ReadRetry(read_retry_s, setting="--read-retry-s", renews=True))
    except (NoManifest, TokenFormatError) as err:
        raise UsageError(f"--data {data}: {err}") from None
    except NotADirectoryError:
        raise UsageError(f"--data {data}: a file, not a prepared dataset; prepare it first "
                         f"(`undying data prepare {data} --tokenizer ... --out DIR`) and give DIR") from None
    except ValueError as err:  # the store's client refusing the URL (an invalid bucket name)
        raise UsageError(f"--data {data}: {err}") from None


def _evaluate(args: argparse.Namespace) -> dict:
    from trainer.evaluation import eval_windows, loss_of_model

    _check_device(args.device)
    if args.seq_len is not None and args.seq_len < 1:
        raise UsageError(f"--seq-len {args.seq_len}: must be a positive number of tokens (or left out: the "
                         "checkpoint's data.seq_len)")
    options = parse_storage_options(args.storage_options, args.storage_options_file)
    catalog = open_catalog(args.url, options)
    step = step_or_fail(catalog, args.step, committed_or_fail(catalog))
    check_read_retry_s(args.read_retry_s)
    dataset = _open_dataset(args.data, options, args.read_retry_s)
    cfg, manifest = _model_of(catalog, step)
    if dataset.vocab_size > cfg.vocab_size:
        raise UsageError(f"--data {args.data}: token ids up to {dataset.vocab_size - 1}, beyond the model's "
                         f"vocabulary of {cfg.vocab_size}; evaluate on data tokenized for this model")
    if (manifest.state.get("engine") or {}).get("data", {}).get("source") == "text":
        raise UsageError(f"--data {args.data}: step {step} was trained on data.source 'text', bytes as ids 0-255, "
                         "and a prepared dataset's ids are its tokenizer's: the loss would measure other words "
                         "behind the same ids; evaluate a model trained on prepared data (source: tokens)")
    trained = manifest.state.get("tokenizer", {})  # what the job's prepared data was tokenized with
    if trained.get("sha256") and dataset.manifest.tokenizer_sha256 != trained["sha256"]:
        raise UsageError(f"--data {args.data}: tokenized with another tokenizer (SHA-256 "
                         f"{dataset.manifest.tokenizer_sha256[:12]}...) than the data step {step} trained on "
                         f"({trained['sha256'][:12]}..., {trained.get('url')}): its ids would mean other words to "
                         "this model; prepare it with that tokenizer")
    seq_len = args.seq_len or manifest.state.get("seq_len") or cfg.max_seq_len
    if seq_len > cfg.max_seq_len:
        raise UsageError(f"--seq-len {seq_len}: beyond the model's max_seq_len {cfg.max_seq_len}")
    try:
        windows = eval_windows(dataset, seq_len, args.windows)
    except ValueError as err:
        raise UsageError(f"--windows {args.windows}: {err}") from None
    result = loss_of_model(_loaded(catalog, step, cfg, manifest, args.device), windows)
    return {"loss": result.loss, "tokens": result.tokens, "step": step, "windows": result.windows,
            "seq_len": result.seq_len, "data": args.data}


def eval_main(args: argparse.Namespace) -> int:
    from ckpt.errors import CorruptCheckpoint

    try:
        out = _evaluate(args)
    except UsageError as err:
        return fail_line(args.as_json, f"undying eval: {err}", EXIT_USAGE)
    except CorruptCheckpoint as err:
        return fail_line(args.as_json, f"undying eval: the checkpoint is damaged: {err}", EXIT_FAILED)
    except Exception as err:
        if not is_storage_error(err):
            raise
        words = explain(err, "--storage-option")  # missing credentials: no rerun helps until they are set
        if words is not None:
            return fail_line(args.as_json, f"undying eval: {words}", EXIT_USAGE)
        return fail_line(args.as_json, f"undying eval: storage error: {error_reason(err)}", EXIT_FAILED)
    if args.as_json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"step {out['step']}: validation loss {out['loss']:.6f} over {out['tokens']} tokens "
              f"({out['windows']} windows of {out['seq_len']} + 1) of {out['data']}")
    return EXIT_OK
