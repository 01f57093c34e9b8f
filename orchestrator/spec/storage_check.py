"""Probe the checkpoint storage before any rank starts.

Protocol: the driver calls `require_storage(spec)` once, after `load_spec` and before it
places any rank; tools that only want the list call `check_storage(url, options)`. Either
runs in the caller's process and returns within `timeout_s` even when the endpoint never
answers. The probe creates a local checkpoint directory if it is missing, writes one small
file under the URL and deletes it; it never creates an object-store bucket, because a
missing bucket is almost always a typo in the URL.

Discovering at the first save, minutes or hours into a run, that the bucket is missing or
read-only wastes the whole run up to that point; this costs one round trip.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ckpt.storage_options import cannot_start, error_reason, explain
from orchestrator.spec.job_spec import JobSpec, Problem, SpecError

FIELD = "checkpoint.url"
# Short and single-attempt: the probe asks "is it there?", and botocore's defaults (60 s
# timeouts, several retries) would turn an unreachable endpoint into minutes of silence.
_S3_PROBE_CONFIG = {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 1}}


def _probe_options(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    options = dict(storage_options)
    if url.split("://", 1)[0] in ("s3", "s3a"):
        options["config_kwargs"] = {**(options.get("config_kwargs") or {}), **_S3_PROBE_CONFIG}
    return options


def _write_problem(url: str, error: BaseException, fs_class=None) -> Problem:
    if words := explain(error, "checkpoint.storage_options", fs_class):
        return Problem("checkpoint.storage_options", f"cannot write a probe file under {url}: {words}")
    if isinstance(error, PermissionError):
        fix = "choose a writable location, or fix the credentials in checkpoint.storage_options"
    elif isinstance(error, (NotADirectoryError, FileExistsError)):
        fix = "part of the path is a file, not a directory; choose another location"
    elif isinstance(error, FileNotFoundError):
        fix = "the location does not exist (for an object store: the bucket); create it or fix the URL"
    else:
        fix = ("check that the endpoint is reachable (checkpoint.storage_options.endpoint_url) "
               "and that the credentials are valid")
    return Problem(FIELD, f"cannot write a probe file under {url} ({error_reason(error)}); {fix}")


def _probe(url: str, storage_options: dict[str, Any]) -> list[Problem]:
    try:
        # skip_instance_cache: the probe's short timeouts must not leak into the cached
        # filesystem instance that the checkpoint writer gets later for the same URL.
        options = _probe_options(url, storage_options)
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
    except (ValueError, ImportError) as error:
        return [Problem(FIELD, f"{url}: unknown or unavailable protocol ({error_reason(error)}); use file://, "
                        "s3:// (with s3fs installed), another installed fsspec protocol, or a local path")]
    except Exception as error:  # a filesystem that rejects its options, or cannot start at all
        field = "checkpoint.storage_options" if storage_options else FIELD
        return [Problem(field, cannot_start(url, bool(storage_options), error))]
    if hasattr(fs, "retries"):
        fs.retries = 1  # s3fs retries connection errors itself, on top of botocore's retries
    probe = f"{root.rstrip('/')}/.undying-probe-{uuid.uuid4().hex}"
    try:
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"undying storage probe\n")
    except Exception as error:  # every failure to write is reported; none is fatal to the caller
        return [_write_problem(url, error, type(fs))]
    try:
        fs.rm_file(probe)
    except Exception as error:
        return [Problem(FIELD, f"{url} accepts writes but not deletes ({error_reason(error)}); checkpoint "
                        "retention (checkpoint.keep) deletes old checkpoints, so grant delete "
                        f"permission and remove {probe}")]
    return []


def check_storage(url: str, storage_options: dict[str, Any], timeout_s: float = 20.0) -> list[Problem]:
    """Problems that stop checkpoints from being written under `url`; empty when it works.

    Blocks for at most `timeout_s`: the probe runs in a daemon thread, so a request that
    hangs below the configured timeouts (a DNS lookup, say) is abandoned, not waited for."""
    if url.startswith("memory://"):
        return [Problem(FIELD, f"{url}: memory:// lives inside one process, and the ranks and the controller are "
                        "separate processes that would never see each other's files; use a shared filesystem "
                        "(file:///...) or an object store (s3://...)")]
    found: list[list[Problem]] = []
    worker = threading.Thread(target=lambda: found.append(_probe(url, storage_options)),
                              name="undying-storage-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not found:
        return [Problem(FIELD, f"{url} did not answer within {timeout_s:g} s; check that the endpoint "
                        "is reachable (checkpoint.storage_options.endpoint_url)")]
    return found[0]


def require_storage(spec: JobSpec, timeout_s: float = 20.0) -> None:
    """Raise SpecError when the spec's checkpoint location cannot be written."""
    problems = check_storage(spec.checkpoint.url, spec.checkpoint.storage_options, timeout_s)
    if problems:
        raise SpecError(problems)
