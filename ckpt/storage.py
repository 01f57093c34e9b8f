"""Where checkpoint bytes go: fsspec URLs, immutable writes and the atomic create of a manifest.

Everything in `ckpt/` addresses storage through a `Storage` built from a URL, never a local
path, so the same code writes `file://`, `s3://` and `memory://`. Write primitives:

* `write_immutable(path, data)`: shard files. A shard path is never written twice with
  different bytes (its name carries step and rank), so a plain overwrite is safe on retry.
  A failure mid-write must not leave a file that looks complete: local files are written
  to a temporary name and renamed; S3 `pipe_file` is a single PUT, or a multipart upload
  that s3fs aborts on error, and neither ever exposes a prefix.
* `atomic_writer(path)`: the same guarantee for data written piece by piece. On S3 the
  object is opened with `autocommit=False` and committed only when the block exits
  cleanly, and the multipart upload is aborted otherwise: with s3fs's default
  `autocommit=True`, an exception inside `with fs.open(p, "wb")` still closes the file
  and so publishes the truncated bytes as the object.
* `create_exclusive(path, data)`: the manifest commit. It succeeds for exactly one writer
  and never replaces an existing object: POSIX `link()` of a finished temp file (rename
  would silently overwrite; the new step directory's own entry is fsynced too), S3 conditional
  PUT `If-None-Match: *` through `pipe_file(..., mode="create")`, always one PUT (a manifest of
  millions of chunks passes s3fs's multipart size, and a store may honour the condition on a
  PUT but not on a multipart completion). Not `open(p, "xb")`: on a multipart write s3fs leaves
  the upload pending when the condition fails. An "exists" answer (EEXIST, HTTP 412) is
  followed by a read-back: identical bytes mean our own request landed earlier (a retry whose
  first answer was lost) and count as success; different bytes raise `AlreadyCommitted`.

Listings: s3fs caches directory listings per filesystem instance, and a cached listing
hides files that other processes wrote since (and makes `exists` answer False for them).
Every `listdir`, `exists` and whole-file `read` here drops the cache first, and every
`Storage` builds its own filesystem instance (`skip_instance_cache`), because fsspec otherwise
hands out one shared, cached instance for equal arguments. `exists` and `listdir` answer "absent" only
for FileNotFoundError and raise any other error: a store that fails is never one without checkpoints.

A writer killed mid multipart upload (SIGKILL) leaves the upload pending: no object, but stored
parts. `remove_tree` (checkpoint GC of unfinished saves) aborts the pending uploads under the tree
it deletes; a bucket lifecycle rule `AbortIncompleteMultipartUpload` covers prefixes GC never visits.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import fsspec

from ckpt.direct_io import DirectFile, open_direct
from ckpt.write_behind import WriteBehindFile
from trainer.urls import range_ignored

# s3fs's own default for pipe_file: bodies under twice this size go in one PUT.
DEFAULT_MULTIPART_CHUNK = 50 * 2**20

# Bytes this process read from durable storage (any protocol but memory://), through every Storage: a restore
# reports its difference as `storage_read_bytes`, so a restore from memory proves it read nothing durable.
_durable_read = {"bytes": 0}
_durable_lock = threading.Lock()


def durable_bytes_read() -> int:
    with _durable_lock:
        return _durable_read["bytes"]


def _count_read(storage: Storage, nbytes: int) -> None:
    if storage.durable:
        with _durable_lock:
            _durable_read["bytes"] += nbytes


class AlreadyCommitted(FileExistsError):
    """The object to create exists already with other bytes (POSIX EEXIST, S3 412 Precondition Failed)."""


def is_precondition_failure(err: BaseException | None) -> bool:
    """Whether `err` (or an exception it was raised from) says "the object exists already".

    s3fs raises FileExistsError only when the 412 error body names the `If-None-Match` condition; servers
    that omit it (SeaweedFS among them) give an OSError whose cause is botocore's ClientError with code
    PreconditionFailed. The check reads the code and HTTP status, never the message text (it may hold paths).
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, FileExistsError):
            return True
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return True
        err = err.__cause__ or err.__context__
    return False


@dataclass
class Storage:
    """A checkpoint root on some fsspec filesystem. Cheap to build; safe to share across threads."""

    url: str
    storage_options: dict = field(default_factory=dict)
    # Bodies of at least twice this size go to S3 as multipart uploads; tests lower it (S3's least part: 5 MiB).
    multipart_chunk: int = DEFAULT_MULTIPART_CHUNK

    def __post_init__(self) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
        self.root = self.root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        self.is_s3 = bool({"s3", "s3a"} & _protocols(self.fs))
        self.durable = "memory" not in _protocols(self.fs)
        if self.is_s3:  # botocore's attempts alone: s3fs's retries of them made a hung store's call minutes long
            self.fs.retries = 1  # before a read's retry budget (ckpt.storage_errors.ReadRetry) saw one error

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # -- writes ------------------------------------------------------------------------

    def write_immutable(self, path: str, data: bytes) -> None:
        if self.is_local:
            os.replace(_durable_temp_copy(path, data), path)
            return
        if self.is_s3:
            self.fs.pipe_file(path, data, chunksize=self.multipart_chunk)
            return
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    @contextlib.contextmanager
    def atomic_writer(self, path: str) -> Iterator[BinaryIO]:
        """A file to write `path` piece by piece; it appears whole when the block exits, or not at all."""
        if self.is_local:
            with _local_atomic_writer(path) as f:
                yield f
        elif self.is_s3:
            f = self.fs.open(path, "wb", autocommit=False, block_size=max(self.multipart_chunk, 5 * 2**20))
            try:
                yield f
                f.close()  # uploads the last part; the object still does not exist
                f.commit()
            except BaseException:
                # Abort the multipart upload, so no part lingers (or is billed); an abort the store fails too
                with contextlib.suppress(Exception):  # leaves it to GC: the write's own error is the one raised
                    f.discard()
                f.closed = True  # else the file's finaliser tries to upload the discarded buffer
                raise
        else:
            buffer = io.BytesIO()
            yield buffer
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, buffer.getvalue())

    def create_exclusive(self, path: str, data: bytes) -> None:
        """Create `path` with `data` iff it does not exist; raise AlreadyCommitted otherwise.

        Idempotent for identical bytes: a retried create that finds its own earlier
        attempt in place succeeds.
        """
        try:
            self._create(path, data)
        except AlreadyCommitted:
            if self._holds(path, data):  # our earlier attempt, whose directory fsync may not have run
                if self.is_local:
                    _fsync_entry(path)
                return
            raise
        finally:
            self.invalidate()

    def _create(self, path: str, data: bytes) -> None:
        if self.is_local:
            self._create_exclusive_posix(path, data)
        elif self.is_s3:
            try:
                self.fs.pipe_file(path, data, mode="create", chunksize=max(self.multipart_chunk, len(data)))
            except Exception as err:
                if is_precondition_failure(err):
                    raise AlreadyCommitted(path) from err
                raise
        else:
            # memory:// and other single-process stores: check-then-write is atomic enough
            # because only the controller commits manifests.
            if self.fs.exists(path):
                raise AlreadyCommitted(path)
            self.fs.pipe_file(path, data)

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self.read(path) == data
        except FileNotFoundError:
            return False

    def _create_exclusive_posix(self, path: str, data: bytes) -> None:
        tmp = _durable_temp_copy(path, data)
        try:
            os.link(tmp, path)  # atomic and exclusive: EEXIST if a manifest is there
        except FileExistsError as err:
            raise AlreadyCommitted(path) from err
        finally:
            os.unlink(tmp)
        _fsync_entry(path)  # durable before we call it committed

    # -- reads -------------------------------------------------------------------------

    def read(self, path: str) -> bytes:
        # s3fs sizes a whole read from its listing cache: FileNotFoundError for a file written since (a beat).
        self.fs.invalidate_cache(path)
        data = self.fs.cat_file(path)
        _count_read(self, len(data))
        return data

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `path` (fewer when the file is shorter); RangeIgnored when the store
        sent more, which it does only when it ignores the Range header (those bytes are not the range)."""
        data = self.fs.cat_file(path, start=start, end=end)
        _count_read(self, len(data))
        if len(data) > end - start:
            raise range_ignored(path, len(data), end - start, start)
        return data

    def read_range_into(self, path: str, start: int, out: memoryview) -> int:
        """Read bytes [start, start + len(out)) of `path` into `out`; returns how many arrived.

        Fewer than `len(out)` means the file is shorter. Local files are read straight into
        `out` (no intermediate bytes object); other stores return the range as bytes (one
        ranged GET on S3, no read-ahead), which are copied in. Through `fs` either way, so
        wrappers of the filesystem (chaos.storage_faults) see every read.
        """
        if self.is_local:
            with self.fs.open(path, "rb") as f:
                f.seek(start)
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
                _count_read(self, got)
                return got
        data = self.read_range(path, start, start + len(out))
        out[:len(data)] = data
        return len(data)

    def exists(self, path: str) -> bool:
        """Whether `path` exists. False only when the store says so (FileNotFoundError); any other
        error raises. fsspec's own `exists` answers False for every exception (the local one turns
        an EIO into "no such file"), and a committed manifest taken for absent is a step skipped at
        restore and a directory that GC takes for an unfinished save and deletes."""
        self.invalidate()
        try:
            self.fs.info(path)
        except FileNotFoundError:
            return False
        return True

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under `path`; empty when it does not exist."""
        self.invalidate()
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    # -- deletes -----------------------------------------------------------------------

    def remove(self, path: str) -> None:
        """Delete one file; a file that is already gone is not an error (another cleaner won)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)
        self.invalidate()

    def remove_tree(self, path: str) -> None:
        """Delete everything under `path`; missing is not an error."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        if self.is_s3:
            # Servers with a real directory tree behind S3 (SeaweedFS's filer) keep the
            # emptied directory and list it as a common prefix until its "dir/" key is
            # deleted; on AWS this deletes nothing and succeeds.
            bucket, key, _ = self.fs.split_path(path)
            if key:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
                self.abort_uploads(path)
        self.invalidate()

    def pending_uploads(self, path: str) -> list[tuple[str, str]]:
        """S3: (key, upload id) of every multipart upload begun and never completed or aborted under `path`:
        a writer killed mid-upload (SIGKILL, a lost node) leaves its upload pending, its parts stored (and
        billed) but shown by no object. Empty on other stores."""
        if not self.is_s3:
            return []
        bucket, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        found, markers = [], {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            # Filtered here as well: not every S3-compatible server honours Prefix.
            found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", []) if u["Key"].startswith(prefix)]
            if not page.get("IsTruncated"):
                return found
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def pending_upload_children(self, path: str) -> set[str]:
        """Names directly under `path` that hold pending multipart uploads (S3; empty elsewhere).

        A writer killed before any of its objects completed leaves a directory that no
        listing shows, only its pending uploads: this is how GC still finds it.
        """
        pending = self.pending_uploads(path)
        if not pending:
            return set()
        prefix = self.fs.split_path(path)[1].rstrip("/") + "/"
        return {key[len(prefix):].split("/", 1)[0] for key, _ in pending if "/" in key[len(prefix):]}

    def abort_uploads(self, path: str) -> int:
        """Abort the pending multipart uploads under `path` (see `pending_uploads`); returns how many.

        Only for a tree being deleted: an upload still in flight there fails, which is what
        deleting its directory means anyway.
        """
        bucket = self.fs.split_path(path)[0]
        pending = self.pending_uploads(path)
        for key, upload_id in pending:
            with contextlib.suppress(FileNotFoundError):  # NoSuchUpload: finished or aborted meanwhile
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        return len(pending)

    def invalidate(self) -> None:
        self.fs.invalidate_cache()


@contextlib.contextmanager
def _local_atomic_writer(path: str) -> Iterator[BinaryIO]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        fd = open_direct(tmp)
        if fd is not None:  # from our buffers to the disk, past the page cache
            try:
                direct = DirectFile(fd)
            except BaseException:  # its buffers could not be mapped: the descriptor is still ours
                os.close(fd)
                raise
            try:
                yield direct
            except BaseException:
                direct.abort()
                raise
            direct.finish()
        else:
            with open(tmp, "wb") as f:
                yield WriteBehindFile(f)  # the disk starts on the first bytes while later ones are produced
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _durable_temp_copy(path: str, data: bytes) -> str:
    """Write `data` next to `path` under a unique temporary name, fsynced; returns that name."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk: no temporary file left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _fsync_entry(path: str) -> None:  # `path`'s directory entry durable, and its directory's (a new step's)
    _fsync_dir(os.path.dirname(path))
    with contextlib.suppress(PermissionError):  # a file in a root under a traverse-only parent: no step made
        _fsync_dir(os.path.dirname(os.path.dirname(path)))


def _fsync_dir(path: str) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    proto = fs.protocol
    return set(proto) if isinstance(proto, (tuple, list)) else {proto}
