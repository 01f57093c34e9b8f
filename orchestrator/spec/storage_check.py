"""Probe the checkpoint storage before any rank starts.

Protocol: the driver calls `require_storage(spec)` once, after `load_spec` and before it
places any rank; tools that only want the list call `check_storage(url, options)`. Either
runs in the caller's process and returns within `timeout_s` even when the endpoint never
answers. The probe creates a local checkpoint directory if it is missing, writes one small
file under the URL and deletes it, then creates one exclusively twice (the second must be
refused, as a manifest commit relies on) and deletes it; it never creates an object-store bucket, because a
missing bucket is almost always a typo in the URL.

Discovering at the first save, minutes or hours into a run, that the bucket is missing or
read-only wastes the whole run up to that point; this costs one round trip.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ckpt.storage import AlreadyCommitted, Storage
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
        # A Storage builds its own client (skip_instance_cache): the probe's short timeouts must not
        # leak into the cached filesystem instance that the checkpoint writer gets for the same URL.
        options = _probe_options(url, storage_options)
        store = Storage(url, options)
        fs, root = store.fs, store.root
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
    return _nesting_problems(url, store) or _exclusive_create_problems(url, store)


MAX_PARENTS = 3  # folders looked at above the URL: a nested job root sits a level or two deep
NESTING_BUDGET_S = 5.0  # the listings' share of the probe's time: past it, no job is assumed


def _nesting_problems(url: str, store: Storage) -> list[Problem]:
    """`checkpoint.url` holds jobs' roots (`<url>/<name>`), so it must be neither a job's root itself
    (the URL `undying ckpt ls` takes, pasted here: the job would start over at step 0 in a folder
    inside it) nor inside one: that job's retention and garbage collection own everything under its
    root, and would delete this job's checkpoints as files of their own steps. Best effort: a folder
    that cannot be listed (a policy that grants only the job's prefix), or listings slower than
    NESTING_BUDGET_S, are taken for no job's; neither a bucket nor a filesystem's root is listed."""
    try:
        return _nesting(url, store, time.monotonic() + NESTING_BUDGET_S)
    except Exception:  # noqa: BLE001 (no evidence of a job: the probe's own checks go on)
        return []


def _nesting(url: str, store: Storage, deadline: float) -> list[Problem]:
    from ckpt.manifest import parse_step_dir
    from ckpt.root_marks import is_job_root

    parts = store.root.rstrip("/").split("/")
    in_step = next((i for i, name in enumerate(parts) if parse_step_dir(name) is not None), None)
    if in_step is None and is_job_root(store.listdir, store.root):
        parent, _, name = url.rstrip("/").rpartition("/")
        return [Problem(FIELD, f"{url} is a job's checkpoint root (it holds step-... folders or an owner lease), "
                        "while checkpoint.url is the folder that holds the jobs' roots (<checkpoint.url>/<name>): "
                        f"did you mean checkpoint.url {parent or '.'} with name {name}?")]
    above = [in_step] if in_step is not None else range(len(parts) - 1, max(1, len(parts) - 1 - MAX_PARENTS), -1)
    for end in above:
        folder = "/".join(parts[:end])
        if end == in_step or (time.monotonic() < deadline and is_job_root(store.listdir, folder)):
            return [Problem(FIELD, f"{url} is inside the checkpoint root {folder} of a job, whose retention and "
                            "garbage collection own every file under it and would delete this job's "
                            "checkpoints; choose a location outside it")]
    return []


def _exclusive_create_problems(url: str, store: Storage) -> list[Problem]:
    """A checkpoint commit creates its manifest exclusively (ckpt.storage.Storage.create_exclusive:
    a hard link on a filesystem, a conditional PUT on S3). A store that cannot fails every commit,
    hours into the run (a FUSE mount of an object store refuses hard links); one that overwrites
    instead would let two commits of one step, or two drivers' claims, replace each other."""
    if not (store.is_local or store.is_s3):
        return []  # (other stores commit by check-then-write: a single committer)
    probe = store.path(f".undying-probe-create-{uuid.uuid4().hex}")
    try:
        store.create_exclusive(probe, b"undying exclusive-create probe\n")
    except Exception as error:  # noqa: BLE001 (whatever the store or the mount says)
        fix = ("use the object store's own URL (s3://...) instead of a FUSE mount of it (gcsfuse, s3fs-fuse, "
               "blobfuse refuse hard links), or a POSIX filesystem" if store.is_local else
               "the store took a plain write but not a conditional one (If-None-Match: *), which every commit "
               "is: use a store that supports conditional writes")
        return [Problem(FIELD, f"{url} cannot create a file exclusively, as every checkpoint commit does "
                        f"({error_reason(error)}); {fix}")]
    try:
        store.create_exclusive(probe, b"a second create, which must be refused\n")
    except AlreadyCommitted:
        return []
    except Exception as error:  # noqa: BLE001
        return [Problem(FIELD, f"{url} failed a second exclusive create ({error_reason(error)}) instead of refusing "
                        "it as a commit needs; check the store")]
    finally:
        with contextlib.suppress(Exception):
            store.fs.rm_file(probe)
    return [Problem(FIELD, f"{url} let a second exclusive create replace a file (an S3-compatible store that "
                    "ignores If-None-Match: *): two commits of one checkpoint could overwrite each other; use a "
                    "store that honours conditional writes")]


def unshared_url_problems(url: str) -> list[Problem]:
    """A checkpoint URL no other process can see (memory://), found without reaching any store:
    `undying validate --offline` checks it too."""
    if not url.startswith("memory://"):
        return []
    return [Problem(FIELD, f"{url}: memory:// lives inside one process, and the ranks and the controller are "
                    "separate processes that would never see each other's files; use a shared filesystem "
                    "(file:///...) or an object store (s3://...)")]


def check_storage(url: str, storage_options: dict[str, Any], timeout_s: float = 20.0) -> list[Problem]:
    """Problems that stop checkpoints from being written under `url`; empty when it works.

    Blocks for at most `timeout_s`: the probe runs in a daemon thread, so a request that
    hangs below the configured timeouts (a DNS lookup, say) is abandoned, not waited for."""
    if unshared := unshared_url_problems(url):
        return unshared
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
