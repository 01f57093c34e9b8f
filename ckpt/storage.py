"""Where checkpoint bytes go: fsspec URLs, immutable writes and the atomic create of a manifest.

Everything in `ckpt/` addresses storage through a `Storage` built from a URL, never a local
path, so the same code writes `file://`, `s3://` and `memory://`. Two write primitives:

* `write_immutable(path, data)`: shard files. A shard path is never written twice with
  different bytes (its name carries step and rank), so a plain overwrite is safe on retry.
  A failure mid-write must not leave a file that looks complete: local files are written
  to a temporary name and renamed; S3 `pipe_file` is a single PUT (or a multipart upload
  aborted on error), which never exposes a prefix.
* `create_exclusive(path, data)`: the manifest commit. It succeeds for exactly one writer
  and never replaces an existing object: POSIX `link()` of a finished temp file (rename
  would silently overwrite), S3 conditional PUT `If-None-Match: *`. A "412 / exists" is
  reported as `AlreadyCommitted` so the caller can read back and compare: it may be its
  own retried write.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

import fsspec


class AlreadyCommitted(FileExistsError):
    """The object to create exists already (POSIX EEXIST, S3 412 Precondition Failed)."""


def _is_precondition_failure(err: BaseException) -> bool:
    # s3fs raises FileExistsError only when the error body names the condition; otherwise an
    # OSError whose cause is botocore's PreconditionFailed / a 412 status.
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, FileExistsError):
            return True
        text = f"{type(err).__name__} {err}"
        if "PreconditionFailed" in text or "412" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


@dataclass
class Storage:
    """A checkpoint root on some fsspec filesystem. Cheap to build; safe to share across threads."""

    url: str
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # skip_instance_cache: fsspec caches filesystems by arguments, and a cached instance
        # carries listing caches that would hide other writers' files (s3fs dircache).
        self.fs, self.root = fsspec.core.url_to_fs(
            self.url, skip_instance_cache=True, **self.storage_options
        )
        self.root = self.root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        self.is_s3 = bool({"s3", "s3a"} & _protocols(self.fs))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def write_immutable(self, path: str, data: bytes) -> None:
        if self.is_local:
            os.replace(_durable_temp_copy(path, data), path)
            return
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create `path` with `data` iff it does not exist; raise AlreadyCommitted otherwise."""
        if self.is_local:
            self._create_exclusive_posix(path, data)
        elif self.is_s3:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except Exception as err:
                if _is_precondition_failure(err):
                    raise AlreadyCommitted(path) from err
                raise
        else:
            # memory:// and other single-process stores: check-then-write is atomic enough
            # because only the controller commits manifests.
            if self.fs.exists(path):
                raise AlreadyCommitted(path)
            self.fs.pipe_file(path, data)
        self.invalidate()

    def _create_exclusive_posix(self, path: str, data: bytes) -> None:
        parent = os.path.dirname(path)
        tmp = _durable_temp_copy(path, data)
        try:
            os.link(tmp, path)  # atomic and exclusive: EEXIST if a manifest is there
        except FileExistsError as err:
            raise AlreadyCommitted(path) from err
        finally:
            os.unlink(tmp)
        dir_fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the new directory entry durable before we call it committed
        finally:
            os.close(dir_fd)

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under `path`; empty when it does not exist."""
        self.invalidate()
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove_tree(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.invalidate()

    def invalidate(self) -> None:
        self.fs.invalidate_cache()


def _durable_temp_copy(path: str, data: bytes) -> str:
    """Write `data` next to `path` under a unique temporary name, fsynced; returns that name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return set(proto) if isinstance(proto, (tuple, list)) else {proto}
