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
    gc       keep the newest --keep committed checkpoints and every one down to the newest that
             verifies (orchestrator.cli.ckpt_gc), and delete unfinished saves older than the
             newest commit, holding the folder's owner lease (ckpt.ownership): refused while a
             job holds it, unless --force

`ls` and `verify` take `--json`: one JSON object on stdout, failures included
(orchestrator.cli.ckpt_listing gives the shapes).

Exit codes: 0 done; 1 `verify` found damage or could not verify a checkpoint, or storage
failed mid-way; 2 the arguments cannot work as given (no such location, no checkpoints, no
such step, bad option): one line naming the argument and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from ckpt.catalog import Catalog
from ckpt.storage_errors import DEFAULT_READ_RETRY_S
from monitor.progress import human_bytes
from orchestrator.cli.ckpt_catalog import (
    committed_or_fail,
    deleted_meanwhile,
    error_reason,
    is_storage_error,
    open_catalog,
    step_or_fail,
)
from orchestrator.cli.ckpt_gc import collect_garbage
from orchestrator.cli.ckpt_listing import list_checkpoints, verify_checkpoints
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, fail_line
from orchestrator.cli.output_paths import checkpoint_root_above
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
    for name in ("ls", "verify"):
        parsers[name].add_argument("--json", dest="as_json", action="store_true",
                                   help="print one JSON object on stdout (errors too: {\"error\": ..., \"exit\": N})")
    parsers["verify"].add_argument("--step", type=int, help="verify only this step (default: every committed one)")
    for name in ("verify", "gc"):
        parsers[name].add_argument("--read-retry-s", type=float, default=DEFAULT_READ_RETRY_S,
                                   help="how long the store's transient read failures may delay the check of one "
                                   "checkpoint before it is reported NOT VERIFIED (default %(default)g)")
    parsers["export"].add_argument("--step", type=int, help="checkpoint to export (default: the newest committed)")
    parsers["export"].add_argument("--out", required=True, help="safetensors file (--format safetensors) or "
                                   "directory (--format hf) to write, a local path")
    parsers["export"].add_argument("--prefix", help="--format safetensors: tensors to export (default: model/)")
    parsers["export"].add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                                   help="safetensors: one file, undying's names; hf: a directory transformers loads")
    parsers["export"].add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="--format hf: cast the weights "
                                   "(default: the dtype the checkpoint holds)")
    parsers["export"].add_argument("--max-shard-size", help="--format hf: split the weights into "
                                   "files of at most this size, with an index (default 5GB)")
    parsers["export"].add_argument("--tokenizer", help="--format hf: tokenizer.json (or its directory) to ship "
                                   "(default: the one the job trained with, when the checkpoint records it; either "
                                   "is read with the storage options given and must match the recorded SHA-256)")
    parsers["gc"].add_argument("--keep", type=int, default=3, help="committed checkpoints kept (default 3, min 1)")
    parsers["gc"].add_argument("--dry-run", action="store_true", help="print what would be deleted (reading the "
                               "checkpoints it verifies, as a real run does); delete nothing")
    parsers["gc"].add_argument("--no-verify", action="store_true",
                               help="keep the newest --keep by age alone, without reading them (by default a "
                               "committed checkpoint is deleted only below the newest one that verifies)")
    parsers["gc"].add_argument("--force", action="store_true",
                               help="delete without the folder's owner lease, even while a job holds it: for a "
                               "lease a dead job left; a job that does run there may lose the save it is "
                               "writing, and with a small --keep the checkpoint it resumed from")


def ckpt_main(args: argparse.Namespace) -> int:
    command = f"undying ckpt {args.ckpt_command}"
    try:
        catalog = open_catalog(args.url, parse_storage_options(args.storage_options, args.storage_options_file))
        return COMMANDS[args.ckpt_command](catalog, args)
    except UsageError as err:
        return _fail(args, f"{command}: {err}", EXIT_USAGE)
    except Exception as err:
        if not is_storage_error(err):
            raise
        # Storage failed after the location was found: not the user's input.
        return _fail(args, f"{command}: storage error: {error_reason(err)}", EXIT_FAILED)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    """The one line of a failed command: on stderr, or as JSON on stdout under --json."""
    return fail_line(getattr(args, "as_json", False), message, code)


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
    from monitor.progress import Progress

    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {args.out} exists and is not an empty directory; choose a new directory")
    recorded = manifest.state.get("tokenizer", {})
    try:
        with Progress(f"undying ckpt export step {step}") as progress:
            files = export_hf(catalog, step, out, dtype=EXPORT_DTYPES.get(args.dtype),
                              max_shard_bytes=parse_size(args.max_shard_size),
                              tokenizer_url=args.tokenizer or recorded.get("url"),
                              tokenizer_sha256=recorded.get("sha256"), storage_options=catalog.storage.storage_options,
                              token_ids=recorded.get("token_ids"), generation=recorded.get("generation"),
                              on_bytes=progress.advance)
    except (ValueError, KeyError) as err:
        raise UsageError(f"--format hf: {err}") from None
    print(f"wrote {out}: {', '.join(files)} (step {step})")
    return EXIT_OK


# Options of one format only: given with the other, they would be ignored without a word.
_FORMAT_ONLY = {"hf": {"dtype": "--dtype", "max_shard_size": "--max-shard-size", "tokenizer": "--tokenizer"},
                "safetensors": {"prefix": "--prefix"}}


def _export(catalog: Catalog, args: argparse.Namespace) -> int:
    for fmt, options in _FORMAT_ONLY.items():
        given = [flag for attr, flag in options.items() if getattr(args, attr) is not None]
        if given and args.format != fmt:
            raise UsageError(f"{', '.join(given)}: for --format {fmt} only (this export is --format {args.format}); "
                             f"drop it, or pass --format {fmt}")
    if "://" in args.out:
        raise UsageError(f"--out {args.out}: an export is written to a local path; write it here, then copy it")
    args.prefix, args.max_shard_size = args.prefix or "model/", args.max_shard_size or "5GB"
    out = os.path.abspath(os.path.expanduser(args.out))
    if args.format != "hf" and os.path.isdir(out):
        raise UsageError(f"--out {args.out} is a directory; give a file name, e.g. {args.out}/model.safetensors")
    if args.format != "hf" and os.path.lexists(out):
        raise UsageError(f"--out {args.out} exists; give a new file name (an export never replaces a file)")
    return _export_checked(catalog, args, _export_hf if args.format == "hf" else _export_safetensors)


def _export_safetensors(catalog: Catalog, step: int, args: argparse.Namespace, manifest) -> int:
    from ckpt.export import export_safetensors
    from monitor.progress import Progress

    if not any(name.startswith(args.prefix) for name in manifest.tensors):
        prefixes = sorted({name.split("/", 1)[0] + "/" for name in manifest.tensors if "/" in name})
        raise UsageError(f"--prefix {args.prefix!r}: checkpoint step {step} has no such tensors; "
                         f"it holds {', '.join(prefixes) or 'tensors without a prefix'}")
    out = os.path.abspath(os.path.expanduser(args.out))
    with Progress(f"undying ckpt export step {step}") as progress:  # damage: _export_checked reports it
        names = export_safetensors(catalog, step, out, prefix=args.prefix, on_bytes=progress.advance)
    print(f"wrote {out}: {len(names)} tensors of step {step} ({human_bytes(os.path.getsize(out))})")
    return EXIT_OK


def _export_checked(catalog: Catalog, args: argparse.Namespace, action) -> int:
    """`action(catalog, step, args, manifest)` on the chosen committed step; damage exits 1. The
    output goes to an existing directory outside a local checkpoint root: retention and garbage
    collection own everything under it, and an export there could replace a checkpoint's file."""
    from ckpt.reader import CorruptCheckpoint, UnsupportedManifest, read_manifest

    out = os.path.realpath(os.path.expanduser(args.out))
    if not os.path.isdir(os.path.dirname(out)):
        raise UsageError(f"--out {args.out}: directory {os.path.dirname(out)} does not exist; create it first")
    if not os.access(os.path.dirname(out), os.W_OK | os.X_OK):  # the export's temporary copy goes there first
        raise UsageError(f"--out {args.out}: directory {os.path.dirname(out)} cannot be written by this user; "
                         "choose a writable place")
    root = os.path.realpath(catalog.storage.root) if catalog.storage.is_local else None
    if root is None or os.path.commonpath([out, root]) != root:
        root = checkpoint_root_above(out)  # another job's, or this one's through a mount of its store
    if root is not None:
        raise UsageError(f"--out {args.out} is inside the checkpoint folder {root}, whose files retention and "
                         "garbage collection own; write the export outside it")
    step = step_or_fail(catalog, args.step, committed_or_fail(catalog))
    try:
        return action(catalog, step, args, read_manifest(catalog, step))
    except UnsupportedManifest as err:
        raise UsageError(f"--step {step}: {err}") from None
    except CorruptCheckpoint as err:
        what = "was deleted meanwhile (by a running job's retention, or `undying ckpt gc`); export a step that is " \
               "kept (`undying ckpt ls`)" if deleted_meanwhile(catalog, step) else f"is damaged: {err}"
        print(f"undying ckpt {args.ckpt_command}: step {step} {what}; nothing written", file=sys.stderr)
        return EXIT_FAILED


COMMANDS = {"ls": list_checkpoints, "verify": verify_checkpoints, "export": _export, "gc": collect_garbage}
