"""`TokenDataset`: random access to the global token stream of a prepared dataset.

Protocol: build one `TokenDataset(url)` per process (it reads and checks `manifest.json`
once; nothing else is trusted), then call `read(start, length)` from any thread: a
prefetching data loader calls it from its own thread while the training thread reads too.
`read` fetches only the bytes of the requested range: on local files through one
read-only memory map per shard (opened on first use, under a lock; the MAX_MAPS most recently
used stay open, each a file descriptor and a kernel mapping), elsewhere as one
ranged read per shard touched (`cat_file(path, start=, end=)`, one ranged GET on S3);
`read_many` reads a step's windows remotely as one concurrent batch of such reads.
The format is described in `trainer/tokens/format.py`.

Remote reads go through `retry.call(read, what)` when a `retry` is given: a rank passes a
ckpt.storage_errors.ReadRetry of `data.read_retry_s` (orchestrator.rank.state), which retries
what the store fails transiently (throttling, 5xx, timeouts) and renews its budget after each
outage, so a store's bad minute costs a multi-day job a wait rather than a rollback to its last
checkpoint. A short read is not retried: it is a damaged shard.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

import fsspec
import numpy as np

from trainer.tokens.format import (
    DOCS_DTYPE,
    DOCS_SUFFIX,
    MANIFEST_NAME,
    TOKENS_SUFFIX,
    NoManifest,
    TokenFormatError,
    TokenManifest,
    numpy_dtype,
    parse_manifest,
)
from trainer.urls import range_ignored

T = TypeVar("T")
MAX_MAPS = 64  # shards kept mapped per dataset and process (a mixture's datasets each keep theirs)


class Retry(Protocol):
    def call(self, fn: Callable[[], T], what: str) -> T: ...

    def one_outage(self) -> contextlib.AbstractContextManager: ...


class _Once:
    def call(self, fn: Callable[[], T], what: str) -> T:
        return fn()

    def one_outage(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class TokenDataset:
    """A committed dataset at `url` (any fsspec URL; a plain path is a local directory)."""

    def __init__(self, url: str, storage_options: dict | None = None, retry: Retry | None = None) -> None:
        self.url = url.rstrip("/")
        self.retry = retry if retry is not None else _Once()
        self.fs, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **(storage_options or {}))
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self._local = "file" in protocols
        if {"s3", "s3a"} & set(protocols):  # as ckpt.storage.Storage: botocore's attempts alone, so that a hung
            self.fs.retries = 1  # store's read fails in about a minute (s3fs's own retries of them made it ~30),
            # into `retry`'s budget (data.read_retry_s), within the hang and collective limits sized by it
        self.manifest = self._read_manifest()
        self.dtype = numpy_dtype(self.manifest.dtype)
        counts = [s.n_tokens for s in self.manifest.shards]
        # offsets[i] is the global position of shard i's first token; offsets[-1] == n_tokens.
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # guards the memory maps
        self._bounds_lock = threading.Lock()
        self._bounds: np.ndarray | None = None

    def _read_manifest(self) -> TokenManifest:
        where = f"{self.url}/{MANIFEST_NAME}"
        try:
            data = self.retry.call(lambda: self.fs.cat_file(f"{self.root}/{MANIFEST_NAME}"), f"reading {where}")
        except FileNotFoundError:
            raise NoManifest(f"no {MANIFEST_NAME} at {self.url}: run `undying data prepare` first "
                             "(or wait for a running one to finish)") from None
        return parse_manifest(data, where)

    # -- what is there ---------------------------------------------------------------

    @property
    def n_tokens(self) -> int:
        return self.manifest.n_tokens

    @property
    def n_documents(self) -> int:
        return self.manifest.n_documents

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    def __len__(self) -> int:
        return self.n_tokens

    def damaged_shards(self) -> list[str]:
        """Each shard file missing, or not the size its manifest entry says, from one listing of the
        dataset's directory: what a rank would meet when it first reads that shard, hours into a
        run, found before any rank starts (orchestrator.spec.data_check)."""
        self.fs.invalidate_cache(self.root)  # the store's listing now, not one an object store client kept
        try:
            listing = self.retry.call(lambda: self.fs.ls(self.root, detail=True), f"listing {self.url}")
        except PermissionError:  # a role that may read the objects but not list them: ask each one
            listing = []
        sizes = {entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry.get("size") for entry in listing}
        out = []
        for shard in self.manifest.shards:
            wanted = [(TOKENS_SUFFIX, shard.n_tokens * self.dtype.itemsize)]
            if shard.n_documents:
                wanted.append((DOCS_SUFFIX, shard.n_documents * DOCS_DTYPE.itemsize))
            for suffix, expected in wanted:
                name, size = f"{shard.name}{suffix}", sizes.get(f"{shard.name}{suffix}")
                if size is None:  # not listed, or listed without a size (HTTP): its own answer decides
                    size = self._size_or_none(f"{self.root}/{name}")
                if size is None:
                    out.append(f"{name} is missing")
                elif size != expected:
                    out.append(f"{name} is {size} bytes where the manifest says {expected}")
        return out

    def _size_or_none(self, path: str) -> int | None:
        try:
            return self.retry.call(lambda: self.fs.size(path), f"sizing {path}")
        except FileNotFoundError:
            return None

    def read_through(self, fs) -> None:
        """Read through `fs` from now on, with its calls also for local files (no memory maps): chaos
        wraps a dataset's file system this way (chaos.storage_faults.install_on_data)."""
        with self._lock:
            self.fs, self._local, self._maps = fs, False, OrderedDict()

    def _path(self, shard: int, suffix: str) -> str:
        return f"{self.root}/{self.manifest.shards[shard].name}{suffix}"

    # -- reads -------------------------------------------------------------------------

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens at global positions [start, start + length) as int64, across shard boundaries.

        Thread-safe. Raises IndexError for a range outside [0, n_tokens) and TokenFormatError
        when a shard file is shorter than its manifest entry says.
        """
        out = np.empty(length, dtype=np.int64)
        with self._shards_present():
            for shard, local, take, at in self._pieces(start, length):
                out[at:at + take] = self._read_shard(shard, local, take)
        return out

    @contextlib.contextmanager
    def _shards_present(self):
        """A shard file that is gone (deleted since the job checked the dataset) is damage that no retry
        or restore mends: said so, naming it, not as a bare FileNotFoundError."""
        try:
            yield
        except FileNotFoundError as err:
            raise TokenFormatError(f"{err.filename or err}: a file of the dataset {self.url} is missing (deleted "
                                   "since the job started); restore it, or prepare the data again") from err

    def read_many(self, spans: list[tuple[int, int]]) -> list[np.ndarray]:
        """`read(start, length)` of each span; remotely as one batch of ranged reads that the file
        system runs concurrently (fsspec's `cat_ranges`: on S3, concurrent GETs instead of one
        round trip per window); while the store fails transiently the ranges that failed are read
        again, with the retry's budget."""
        if self._local:
            return [self.read(start, length) for start, length in spans]
        outs, jobs = [], []
        for start, length in spans:
            outs.append(np.empty(length, dtype=np.int64))
            jobs += [(outs[-1], at, shard, local, take) for shard, local, take, at in self._pieces(start, length)]
        size = self.dtype.itemsize
        paths = [self._path(shard, TOKENS_SUFFIX) for _, _, shard, _, _ in jobs]
        blobs: list = [None] * len(jobs)
        pending = list(range(len(jobs)))

        def fetch() -> None:  # the ranges still missing: a retry reads again only those that failed
            got = self.fs.cat_ranges([paths[i] for i in pending], [jobs[i][3] * size for i in pending],
                                     [(jobs[i][3] + jobs[i][4]) * size for i in pending], on_error="return")
            failed = []
            for i, data in zip(list(pending), got, strict=True):
                if isinstance(data, BaseException):
                    failed.append((i, data))
                else:
                    blobs[i] = data
            pending[:] = [i for i, _ in failed]
            if failed:
                raise failed[0][1]

        with self._shards_present():
            self.retry.call(fetch, f"reading {len(jobs)} token ranges of {self.url}")
        for (out, at, _, local, take), path, data in zip(jobs, paths, blobs, strict=True):
            out[at:at + take] = self._tokens_of(path, data, local, take)
        return outs

    def _pieces(self, start: int, length: int) -> list[tuple[int, int, int, int]]:
        """(shard, first token in the shard, tokens, offset in the range) of each shard [start, start +
        length) touches; IndexError for a range outside the dataset."""
        if start < 0 or length < 0 or start + length > self.n_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) are outside [0, {self.n_tokens}) of {self.url}")
        pieces, done = [], 0
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while done < length:
            take = min(length - done, int(self.offsets[shard + 1]) - (start + done))
            if take > 0:
                pieces.append((shard, start + done - int(self.offsets[shard]), take, done))
                done += take
            shard += 1
        return pieces

    def _read_shard(self, shard: int, local: int, count: int) -> np.ndarray:
        if self._local:
            return self._map(shard)[local:local + count]
        size = self.dtype.itemsize
        path = self._path(shard, TOKENS_SUFFIX)
        data = self.retry.call(lambda: self.fs.cat_file(path, start=local * size, end=(local + count) * size),
                               f"reading tokens [{local}, {local + count}) of {path}")
        return self._tokens_of(path, data, local, count)

    def _tokens_of(self, path: str, data: bytes, local: int, count: int) -> np.ndarray:
        size = self.dtype.itemsize
        if len(data) > count * size:  # not damage: the store ignores Range
            raise range_ignored(path, len(data), count * size, local * size)
        if len(data) != count * size:  # short: the shard is damaged, and reading again will not mend it
            raise TokenFormatError(f"{path}: {len(data)} bytes where {count * size} were expected at byte "
                                   f"{local * size}; the shard is truncated, prepare the data again")
        return np.frombuffer(data, dtype=self.dtype)

    def _map(self, shard: int) -> np.ndarray:
        """Shard `shard`'s memory map. Windows land on every shard in turn: keeping each one open
        would hold a descriptor and a mapping per shard (10B tokens are over a thousand shards:
        past a process's default descriptor limit), so past MAX_MAPS the least recently used is
        dropped (closed once the last window viewing it is gone)."""
        with self._lock:
            found = self._maps.get(shard)
            if found is not None:
                self._maps.move_to_end(shard)
                return found
            path = self._path(shard, TOKENS_SUFFIX)
            expected = self.manifest.shards[shard].n_tokens * self.dtype.itemsize
            actual = self.fs.size(path)
            if actual != expected:
                raise TokenFormatError(f"{path}: {actual} bytes where the manifest says {expected}; "
                                       "the shard is damaged, prepare the data again")
            mapped = np.memmap(path, dtype=self.dtype, mode="r")
            # Training reads windows at random places: no read-ahead around each one, which on
            # a cold cache would read far more of the file from disk than the windows.
            mapped._mmap.madvise(mmap.MADV_RANDOM)
            self._maps[shard] = mapped
            while len(self._maps) > MAX_MAPS:
                self._maps.popitem(last=False)
            return mapped

    def document_bounds(self) -> np.ndarray:
        """Global exclusive end offsets of every document, int64, in stream order (cached).

        Reads every shard's `.docs` file once (8 bytes per document); thread-safe.
        """
        with self._bounds_lock:
            if self._bounds is None:
                parts = [np.zeros(0, dtype=np.int64)]
                for i, entry in enumerate(self.manifest.shards):
                    if not entry.n_documents:
                        continue
                    path = self._path(i, DOCS_SUFFIX)
                    with self._shards_present():
                        data = self.retry.call(lambda path=path: self.fs.cat_file(path), f"reading {path}")
                    if len(data) != entry.n_documents * DOCS_DTYPE.itemsize:
                        raise TokenFormatError(f"{path}: {len(data)} bytes for {entry.n_documents} documents; "
                                               "the shard is damaged, prepare the data again")
                    parts.append(np.frombuffer(data, dtype=DOCS_DTYPE).astype(np.int64) + self.offsets[i])
                self._bounds = np.concatenate(parts)
            return self._bounds
