"""Finding a job's checkpoints for the `undying ckpt` and `undying eval` commands, and how they read.

Each command opens the URL with `open_catalog`, then asks `committed_or_fail` (and, for one step,
`step_or_fail`); each raises `UsageError` with one line that names the argument and the fix (no such
location, the parent of the job's root given, only unfinished saves, no such step). Storage that
fails after the location was found is not a usage error: callers test `is_storage_error` and print
`error_reason` (ckpt.storage_options, imported here with the rest).
"""

from __future__ import annotations

import json
import math

from ckpt.catalog import QUARANTINED_PREFIX, Catalog
from ckpt.manifest import parse_step_dir, step_dir
from ckpt.storage import Storage
from ckpt.storage_options import cannot_start, error_reason, explain, open_now
from orchestrator.cli.exits import UsageError
from trainer.urls import absolute_url

# -- arguments ---------------------------------------------------------------------------

def normalise_url(url: str) -> str:
    if not url.strip():
        raise UsageError("URL is empty; give the job's checkpoint root, e.g. file:///data/ckpt/myjob")
    try:
        return absolute_url(url)
    except ValueError as err:  # a URL mistyped into a relative path
        raise UsageError(f"URL {err}") from None


def check_read_retry_s(seconds: float) -> None:
    """`--read-retry-s` of `ckpt verify` and `ckpt gc`: a finite number of seconds, 0 or more."""
    if not 0 <= seconds < math.inf:  # (nan compares false: it would retry for ever)
        raise UsageError(f"--read-retry-s {seconds:g}: must be 0 (no retry) or a finite number of seconds")


def unknown_protocol(named: str, err: BaseException) -> str:
    """The line for a URL fsspec has no file system for (`named`: the argument and its value)."""
    return (f"{named}: unknown or unavailable protocol ({error_reason(err)}); use file://, s3:// (with s3fs "
            "installed) or a local path")


def is_storage_error(err: BaseException) -> bool:
    """OSError, or an error of the S3 client stack (botocore's own errors are not OSErrors); not a closed
    pipe on our own output (`ckpt verify | head`), which the CLI's main ends quietly."""
    if isinstance(err, BrokenPipeError):
        return False
    return isinstance(err, OSError) or type(err).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def deleted_meanwhile(catalog: Catalog, step: int) -> bool:
    """Whether committed `step` is no longer committed: its read failed because a running job's retention
    (or `undying ckpt gc`) deleted it since it was listed, not because it is damaged. A step a running
    job quarantined meanwhile (found corrupt: its manifest moved aside) was not deleted: it is damaged."""
    try:
        catalog.storage.invalidate()
        storage = catalog.storage
        if storage.exists(catalog.manifest_path(step)):
            return False
        aside = storage.listdir(storage.path(step_dir(step)))  # (this step's folder alone: an error path)
        return not any(name.startswith(QUARANTINED_PREFIX) for name in aside)
    except Exception:  # noqa: BLE001 (a store that fails now proves nothing: the damage message stands)
        return False


def open_catalog(url: str, options: dict) -> Catalog:
    url = normalise_url(url)
    try:
        storage = Storage(url, options)
    except (ValueError, ImportError) as err:
        raise UsageError(unknown_protocol(f"URL {url}", err)) from None
    except Exception as err:  # a filesystem that rejects its options, or cannot start at all
        raise UsageError(_cannot_open(url, options, err)) from None
    try:
        open_now(storage)  # an option the store's client refuses fails here, named, not in the first call
    except Exception as err:
        words = explain(err, "--storage-option", type(storage.fs))
        raise UsageError(words or _cannot_open(url, options, err)) from None
    return Catalog(storage)


def _cannot_open(url: str, options: dict, err: Exception) -> str:
    return ("--storage-option: " if options else "URL ") + cannot_start(url, bool(options), err)


# -- what is there -----------------------------------------------------------------------

def committed_or_fail(catalog: Catalog) -> list[int]:
    """Committed steps, oldest first; a UsageError that says why when there are none."""
    url = catalog.storage.url
    try:
        committed = catalog.committed_steps()
        if committed:
            return committed
        unfinished = catalog.all_steps()
        quarantined = catalog.quarantined_steps() if unfinished else []
        exists = bool(unfinished) or catalog.storage.exists(catalog.storage.root)
        jobs = [] if unfinished or not exists else _job_dirs(catalog.storage)
    except PermissionError as err:
        raise UsageError(f"URL {url}: access denied ({error_reason(err)}); check the credentials "
                         "(the environment's AWS_* variables, or --storage-options-file)") from None
    except NotADirectoryError:
        raise UsageError(f"URL {url} is a file, not a checkpoint root; give checkpoint.url/<job name>, the "
                         "directory the job's checkpoints are in") from None
    except Exception as err:  # unreachable endpoint (botocore errors are not OSErrors), bad bucket name...
        if not is_storage_error(err):
            raise
        raise UsageError(f"URL {url}: cannot list it ({error_reason(err)}); "
                         + (explain(err, "--storage-option") or "check the URL and the endpoint "
                            "(--storage-option endpoint_url=...)")) from None
    if jobs:
        raise UsageError(f"URL {url} holds job directories, not checkpoints; give one job's checkpoint root, "
                         f"e.g. {url}/{jobs[0]}")
    if quarantined:
        rest = sorted(set(unfinished) - set(quarantined))
        raise UsageError(f"URL {url} has no committed checkpoint: steps {steps_text(quarantined)} were quarantined "
                         "as corrupt (manifests moved aside, files kept as evidence)"
                         + (f", steps {steps_text(rest)} are unfinished saves" if rest else "")
                         + "; `undying run --fresh` starts the job over from step 0")
    if unfinished:
        raise UsageError(f"URL {url} has no committed checkpoint, only unfinished saves (steps "
                         f"{steps_text(unfinished)}); nothing to work on until a save commits")
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


def steps_text(steps: list[int], shown: int = 8) -> str:
    text = ", ".join(str(s) for s in steps[:shown])
    return text + (f" and {len(steps) - shown} more" if len(steps) > shown else "")


def about(step: int, err: BaseException) -> str:
    """The error's message without a leading "step N: " (the caller prints the step itself)."""
    return str(err).removeprefix(f"step {step}: ")


def step_or_fail(catalog: Catalog, step: int | None, committed: list[int]) -> int:
    if step is None:
        return committed[-1]
    if step not in committed:
        raise UsageError(f"--step {step}: no committed checkpoint at step {step} under {catalog.storage.url}; "
                         f"committed steps: {steps_text(committed)} (see `undying ckpt ls`)")
    return step


# -- how a listing reads ----------------------------------------------------------------

def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def layout_label(layout: dict) -> str:
    known = [f"{k}{layout[k]}" for k in ("dp", "tp", "pp", "zero") if k in layout]
    return " ".join(known) or json.dumps(layout, sort_keys=True)
