"""`undying ckpt ls|verify|export|gc URL`: inspect and maintain a job's checkpoints offline.

URL is the job's checkpoint root, the directory `undying run` writes to: `checkpoint.url`
of the spec with the job name appended (`<checkpoint.url>/<name>`); a plain path means a
local directory. `--storage-option KEY=VALUE` (repeatable) is passed to fsspec, e.g.
`endpoint_url=http://127.0.0.1:8333`; credentials (`key`, `secret`, ...) come from the
environment or `--storage-options-file PATH`, never from the command line (refused: `ps`
shows every argument).

    ls       committed checkpoints: step, layout, size, age (manifests only, no shard reads)
    verify   read every chunk of every (or one, --step) committed checkpoint and check its CRC;
             a checkpoint the store keeps failing to read for --read-retry-s is reported NOT
             VERIFIED (that proves nothing about its bytes) and the next one is checked
    export   the `model/...` tensors of one checkpoint: a safetensors file, prefix removed
             (--format safetensors), or a Hugging Face model directory (--format hf)
    gc       keep the newest --keep committed checkpoints (never the newest one) and delete
             unfinished saves older than the newest commit

Exit codes: 0 done; 1 `verify` found damage or could not verify a checkpoint, or storage
failed mid-way; 2 the arguments cannot work as given (no such location, no checkpoints, no
such step, bad option): one line naming the argument and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ckpt.catalog import Catalog
from ckpt.config import normalise_url as checkpoint_url
from ckpt.errors import TransientStorageError
from ckpt.manifest import Manifest, parse_step_dir
from ckpt.storage import Storage
from ckpt.storage_errors import DEFAULT_READ_RETRY_S, ReadRetry
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from orchestrator.cli.storage_args import add_storage_option_args, parse_storage_options


def add_ckpt_parser(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="list, verify, export and garbage-collect a job's checkpoints")
    actions = ckpt.add_subparsers(dest="ckpt_command", required=True)
    parsers = {
        "ls": actions.add_parser("ls", help="committed checkpoints: step, layout, size, age"),
        "verify": actions.add_parser("verify", help="check the checksum of every chunk of every shard"),
        "export": actions.add_parser("export", help="model weights of one checkpoint as safetensors"),
        "gc": actions.add_parser("gc", help="delete old checkpoints and unfinished saves"),
    }
    for p in parsers.values():
        p.add_argument("url", metavar="URL", help="the job's checkpoint root: <checkpoint.url>/<job name>")
        add_storage_option_args(p, "fsspec storage option, e.g. endpoint_url=http://host:8333 "
                                "(repeatable; true/false and {...} JSON values are decoded, the rest are strings)")
    parsers["verify"].add_argument("--step", type=int, help="verify only this step (default: every committed one)")
    parsers["verify"].add_argument("--read-retry-s", type=float, default=DEFAULT_READ_RETRY_S,
                                   help="how long the store's transient read failures may delay the check of one "
                                   "checkpoint before it is reported NOT VERIFIED (default %(default)g)")
    parsers["export"].add_argument("--step", type=int, help="checkpoint to export (default: the newest committed)")
    parsers["export"].add_argument("--out", required=True, help="safetensors file (--format safetensors) or "
                                   "directory (--format hf) to write, a local path")
    parsers["export"].add_argument("--prefix", default="model/", help="tensors to export (default: model/)")
    parsers["export"].add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                                   help="safetensors: one file, undying's names; hf: a directory transformers loads")
    parsers["export"].add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="--format hf: cast the weights "
                                   "(default: the dtype the checkpoint holds)")
    parsers["export"].add_argument("--max-shard-size", default="5GB", help="--format hf: split the weights into "
                                   "files of at most this size, with an index (default 5GB)")
    parsers["export"].add_argument("--tokenizer", help="--format hf: tokenizer.json (or its directory) to ship "
                                   "(default: the one the job trained with, when the checkpoint records it)")
    parsers["gc"].add_argument("--keep", type=int, default=3, help="committed checkpoints kept (default 3, min 1)")
    parsers["gc"].add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")


def ckpt_main(args: argparse.Namespace) -> int:
    command = f"undying ckpt {args.ckpt_command}"
    try:
        catalog = open_catalog(args.url, parse_storage_options(args.storage_options, args.storage_options_file))
        return COMMANDS[args.ckpt_command](catalog, args)
    except UsageError as err:
        print(f"{command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:
        if not is_storage_error(err):
            raise
        # Storage failed after the location was found: not the user's input.
        print(f"{command}: storage error: {error_reason(err)}", file=sys.stderr)
        return EXIT_FAILED


# -- arguments ---------------------------------------------------------------------------

def normalise_url(url: str) -> str:
    if not url.strip():
        raise UsageError("URL is empty; give the job's checkpoint root, e.g. file:///data/ckpt/myjob")
    return checkpoint_url(url)


def is_storage_error(err: BaseException) -> bool:
    """OSError, or an error of the S3 client stack (botocore's own errors are not OSErrors)."""
    return isinstance(err, OSError) or type(err).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def error_reason(err: BaseException, limit: int = 200) -> str:
    """`Type: message` on one line, at most `limit` characters: how every command names a storage error."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def open_catalog(url: str, options: dict) -> Catalog:
    url = normalise_url(url)
    try:
        storage = Storage(url, options)
    except (ValueError, ImportError) as err:
        raise UsageError(f"URL {url}: unknown or unavailable protocol ({error_reason(err)}); use file://, "
                         "s3:// (with s3fs installed) or a local path") from None
    except Exception as err:  # a filesystem that rejects its options
        raise UsageError(f"--storage-option: cannot open {url} with these options ({error_reason(err)}); "
                         "fix or remove the offending option") from None
    return Catalog(storage)


# -- what is there -----------------------------------------------------------------------

def committed_or_fail(catalog: Catalog) -> list[int]:
    """Committed steps, oldest first; a UsageError that says why when there are none."""
    url = catalog.storage.url
    try:
        committed = catalog.committed_steps()
        if committed:
            return committed
        unfinished = catalog.all_steps()
        exists = bool(unfinished) or catalog.storage.exists(catalog.storage.root)
        jobs = [] if unfinished or not exists else _job_dirs(catalog.storage)
    except PermissionError as err:
        raise UsageError(f"URL {url}: access denied ({error_reason(err)}); check the credentials "
                         "(the environment's AWS_* variables, or --storage-options-file)") from None
    except Exception as err:  # unreachable endpoint (botocore errors are not OSErrors), bad bucket name...
        if not is_storage_error(err):
            raise
        raise UsageError(f"URL {url}: cannot list it ({error_reason(err)}); check the URL and the endpoint "
                         "(--storage-option endpoint_url=...)") from None
    if jobs:
        raise UsageError(f"URL {url} holds job directories, not checkpoints; give one job's checkpoint root, "
                         f"e.g. {url}/{jobs[0]}")
    if unfinished:
        raise UsageError(f"URL {url} has no committed checkpoint, only unfinished saves (steps "
                         f"{_steps(unfinished)}); nothing to work on until a save commits")
    what = "does not exist" if not exists else "has no checkpoints"
    raise UsageError(f"URL {url} {what}; give the job's checkpoint root, <checkpoint.url>/<job name> "
                     "(the directory with step-NNNNNNNNN/ entries)")


def _job_dirs(storage: Storage, limit: int = 10) -> list[str]:
    """Children of the root that hold step directories (the user gave checkpoint.url itself)."""
    found = []
    for name in storage.listdir(storage.root)[:limit]:
        if any(parse_step_dir(child) is not None for child in storage.listdir(storage.path(name))):
            found.append(name)
    return found


def _steps(steps: list[int], shown: int = 8) -> str:
    text = ", ".join(str(s) for s in steps[:shown])
    return text + (f" and {len(steps) - shown} more" if len(steps) > shown else "")


def _about(step: int, err: BaseException) -> str:
    """The error's message without a leading "step N: " (the caller prints the step itself)."""
    return str(err).removeprefix(f"step {step}: ")


def step_or_fail(catalog: Catalog, step: int | None, committed: list[int]) -> int:
    if step is None:
        return committed[-1]
    if step not in committed:
        raise UsageError(f"--step {step}: no committed checkpoint at step {step} under {catalog.storage.url}; "
                         f"committed steps: {_steps(committed)} (see `undying ckpt ls`)")
    return step


# -- ls ----------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def layout_label(layout: dict) -> str:
    known = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "zero") if k in layout]
    return " ".join(known) or json.dumps(layout, sort_keys=True)


def _ls(catalog: Catalog, args: argparse.Namespace) -> int:
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest

    committed = committed_or_fail(catalog)
    unfinished = sorted(set(catalog.all_steps()) - set(committed))
    now = time.time()
    print(f"{catalog.storage.url}: {len(committed)} committed checkpoint(s)")
    print(f"{'step':>10}  {'layout':<22}{'size':>11}{'age':>10}{'gen':>5}{'tensors':>9}")
    for step in committed:
        try:
            m: Manifest = read_manifest(catalog, step)
        except (CorruptCheckpoint, UnsupportedManifest) as err:
            print(f"{step:>10}  unreadable: {err}")
            continue
        print(f"{step:>10}  {layout_label(m.layout):<22}{human_bytes(m.total_bytes):>11}"
              f"{human_age(now - m.created_at):>10}{m.generation:>5}{len(m.tensors):>9}")
    stale = [s for s in unfinished if s < committed[-1]]
    newer = [s for s in unfinished if s > committed[-1]]
    if stale:
        print(f"unfinished saves (no manifest): steps {_steps(stale)}; `undying ckpt gc` deletes them")
    if newer:
        print(f"saves in progress or abandoned (no manifest yet): steps {_steps(newer)}")
    return EXIT_OK


# -- verify ------------------------------------------------------------------------------

def _verify(catalog: Catalog, args: argparse.Namespace) -> int:
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest, verify_checkpoint

    if args.read_retry_s < 0:
        raise UsageError(f"--read-retry-s {args.read_retry_s:g}: must be 0 (no retry) or more seconds")
    committed = committed_or_fail(catalog)
    steps = [step_or_fail(catalog, args.step, committed)] if args.step is not None else committed
    bad: dict[int, str] = {}
    for step in steps:
        started = time.perf_counter()
        retry = ReadRetry(args.read_retry_s)  # one budget for the checkpoint's manifest and all its chunks
        try:
            manifest = read_manifest(catalog, step, retry)
            verify_checkpoint(catalog, step, retry)
        except CorruptCheckpoint as err:
            bad[step] = _about(step, err)
            print(f"step {step}: CORRUPT: {bad[step]}")
            continue
        except TransientStorageError as err:  # proves nothing about this one; the others are still checked
            bad[step] = f"not verified, the store kept failing: {_about(step, err)}"
            print(f"step {step}: NOT VERIFIED (transient storage errors): {_about(step, err)}")
            continue
        except UnsupportedManifest as err:  # not damage, but not verifiable by this version either
            bad[step] = _about(step, err)
            print(f"step {step}: NOT VERIFIED: {bad[step]}")
            continue
        files = {c.file for e in manifest.tensors.values() for c in e.chunks}
        chunks = sum(len(e.chunks) for e in manifest.tensors.values())
        print(f"step {step}: ok ({len(manifest.tensors)} tensors, {chunks} chunks in {len(files)} shard files, "
              f"{human_bytes(manifest.total_bytes)}, {time.perf_counter() - started:.2f} s)")
    if bad:
        print(f"undying ckpt verify: {len(bad)} of {len(steps)} checkpoint(s) failed: "
              + "; ".join(f"step {s}: {why}" for s, why in bad.items()), file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


# -- export ------------------------------------------------------------------------------

EXPORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (transformers' spelling of shard sizes)."""
    number = text.strip().upper()
    unit = next((u for u in _SIZE_UNITS if number.endswith(u)), "B")
    try:
        value = float(number[: len(number) - len(unit)] if number.endswith(unit) else number)
    except ValueError:
        raise UsageError(f"--max-shard-size {text!r}: not a size; use e.g. 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise UsageError(f"--max-shard-size {text!r}: must be positive")
    return int(value * _SIZE_UNITS[unit])


def _export_hf(catalog: Catalog, step: int, args: argparse.Namespace, manifest) -> int:
    from ckpt.hf_export import export_hf

    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {args.out} exists and is not an empty directory; choose a new directory")
    tokenizer = args.tokenizer or manifest.state.get("tokenizer", {}).get("url")
    try:
        files = export_hf(catalog, step, out, dtype=EXPORT_DTYPES.get(args.dtype),
                          max_shard_bytes=parse_size(args.max_shard_size), tokenizer_url=tokenizer,
                          token_ids=manifest.state.get("tokenizer", {}).get("token_ids"))
    except (ValueError, KeyError) as err:
        raise UsageError(f"--format hf: {err}") from None
    print(f"wrote {out}: {', '.join(files)} (step {step})")
    return EXIT_OK


def _export(catalog: Catalog, args: argparse.Namespace) -> int:
    from ckpt.export import export_safetensors
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest

    if args.format == "hf":
        return _export_checked(catalog, args, _export_hf)
    out = os.path.abspath(os.path.expanduser(args.out))
    if not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"--out {args.out}: directory {os.path.dirname(out)} does not exist; create it first")
    if os.path.isdir(out):
        raise UsageError(f"--out {args.out} is a directory; give a file name, e.g. {args.out}/model.safetensors")
    committed = committed_or_fail(catalog)
    step = step_or_fail(catalog, args.step, committed)
    try:
        manifest = read_manifest(catalog, step)
    except UnsupportedManifest as err:
        raise UsageError(f"--step {step}: {err}") from None
    except CorruptCheckpoint as err:
        print(f"undying ckpt export: step {step} is damaged, nothing written: {err}", file=sys.stderr)
        return EXIT_FAILED
    if not any(name.startswith(args.prefix) for name in manifest.tensors):
        prefixes = sorted({name.split("/", 1)[0] + "/" for name in manifest.tensors if "/" in name})
        raise UsageError(f"--prefix {args.prefix!r}: checkpoint step {step} has no such tensors; "
                         f"it holds {', '.join(prefixes) or 'tensors without a prefix'}")
    try:
        names = export_safetensors(catalog, step, out, prefix=args.prefix)
    except CorruptCheckpoint as err:
        print(f"undying ckpt export: step {step} is damaged, nothing written: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {out}: {len(names)} tensors of step {step} ({human_bytes(os.path.getsize(out))})")
    return EXIT_OK


def _export_checked(catalog: Catalog, args: argparse.Namespace, action) -> int:
    """`action(catalog, step, args, manifest)` on the chosen committed step; damage exits 1."""
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest

    if not os.path.isdir(os.path.dirname(os.path.abspath(os.path.expanduser(args.out)))):
        raise UsageError(f"--out {args.out}: its parent directory does not exist; create it first")
    step = step_or_fail(catalog, args.step, committed_or_fail(catalog))
    try:
        return action(catalog, step, args, read_manifest(catalog, step))
    except UnsupportedManifest as err:
        raise UsageError(f"--step {step}: {err}") from None
    except CorruptCheckpoint as err:
        print(f"undying ckpt {args.ckpt_command}: step {step} is damaged, nothing written: {err}", file=sys.stderr)
        return EXIT_FAILED


# -- gc ----------------------------------------------------------------------------------

def _gc(catalog: Catalog, args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep {args.keep}: must be at least 1; the newest committed checkpoint is never deleted")
    committed = committed_or_fail(catalog)
    plan = catalog.gc_plan(args.keep)
    verb = "would delete" if args.dry_run else "deleted"
    if not args.dry_run:
        catalog.apply_gc(plan)
    kept = [s for s in committed if s not in plan.expired]
    if not plan.expired and not plan.orphans:
        print(f"nothing to delete: {len(committed)} committed checkpoint(s), --keep {args.keep}")
    if plan.expired:
        print(f"{verb} committed checkpoints: steps {_steps(plan.expired)}")
    if plan.orphans:
        print(f"{verb} unfinished saves: steps {_steps(plan.orphans)}")
    print(f"kept: steps {_steps(kept)}")
    return EXIT_OK


COMMANDS = {"ls": _ls, "verify": _verify, "export": _export, "gc": _gc}
