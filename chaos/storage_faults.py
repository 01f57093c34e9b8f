"""Storage faults on a live `ckpt.storage.Storage`: failed, slow and torn checkpoint I/O.

Protocol: the process that owns a Storage (a rank, for its shard writes; the controller,
for manifest commits, listings and deletes) calls

    undo = install(storage, faults, seed=chaos.seed, notify=push_event)
    ...  # checkpoint I/O, some of which now fails as `faults` say (chaos.storage_rules)
    undo()

before the I/O to disturb; `undo()` restores the storage object exactly (installs nest, and
are undone in reverse order). `faults` are FaultSpecs or their dicts; kinds other than the
storage kinds are ignored, so a job's whole fault list can be passed. `install` is also a
context manager (`with install(storage, faults): ...`). Nothing is edited in ckpt/: the
Storage instance's `fs` is swapped for a `FaultyFileSystem` that wraps it.

`FaultyFileSystem(fs, plan)` is a delegating fsspec filesystem around any instance (file,
memory, s3, ...). It is never cached (fsspec caches instances built with equal arguments,
and a cached faulty instance would hand its faults to unrelated code), and it never
modifies the instance it wraps: other users of that instance see no fault. Calls are
classified as write, read, list or delete (`_OPS`); the rest (makedirs, cache
invalidation, s3fs's own helpers) pass through untouched.

Local storage: `Storage` writes file:// shards and manifests with os calls (temp file,
fsync, rename or link) that bypass `fs`, so `install` also shadows the instance's
`write_immutable`, `create_exclusive` and `atomic_writer` with versions that consult the
same plan around the original method. A torn write lands its prefix at the final path on
every backend (the worst a non-atomic writer can do); a correct reader must still refuse it.

Note for readers of faults: an injected read error (EIO) or throttle (503 SlowDown) is
transient to ckpt.storage_errors.classify, so a restore retries it for
`checkpoint.read_retry_s` and, when it lasts longer, the job fails naming the checkpoint;
it never makes the controller fall back (only corrupt_shard and torn_write damage bytes).
A rank's faults with `op: read` act on its restore reads (orchestrator.rank.state). Faults with
`target: data` act on the ranks' training data reads instead (`install_on_data`, from the rank
loop); the reads wait them out for `data.read_retry_s` (trainer.tokens.reader).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from fsspec.spec import AbstractFileSystem

from chaos.config import ArmedFault, FaultSpec
from chaos.storage_rules import InjectedStorageError, InjectedThrottle, StorageFaultPlan, Verdict

__all__ = ["FaultyFileSystem", "InjectedStorageError", "InjectedThrottle", "Installed", "StorageFaultPlan", "install",
           "install_on_data"]

# method -> (operation, index of the path argument, its keyword name)
_OPS: dict[str, tuple[str, int, str]] = {
    "put_file": ("write", 1, "rpath"), "cp_file": ("write", 1, "path2"), "touch": ("write", 0, "path"),
    "cat_file": ("read", 0, "path"), "get_file": ("read", 0, "rpath"),
    **{name: ("list", 0, "path") for name in (
        "ls", "info", "exists", "isdir", "isfile", "find", "glob", "walk", "du", "modified", "created",
        "checksum", "size", "ukey")},
    **{name: ("delete", 0, "path") for name in ("rm_file", "rm", "rmdir", "_rm")},
}
_PASSTHROUGH = ("makedirs", "mkdir", "makedir", "mkdirs", "invalidate_cache", "expand_path", "sign",
                "unstrip_protocol")


def _run(plan: StorageFaultPlan, op: str, path: str, call: Callable[[], object],
         tear: Callable[[float], str] | None = None) -> object:
    """Do `call` as the plan's verdict for (op, path) says. `tear(fraction)` writes a prefix."""
    verdict = plan.judge(op, path)
    if verdict.clean:
        return call()
    if verdict.delay_s:
        plan.sleep(verdict.delay_s)
    if verdict.fail == "before" or (verdict.keep_fraction is not None and tear is None):
        raise verdict.error(op, path)
    if verdict.keep_fraction is not None:
        raise verdict.error(op, path, tear(verdict.keep_fraction))
    result = call()
    if verdict.fail == "after":
        raise verdict.error(op, path, " (the call itself succeeded)")
    return result


def _land_prefix(fs: AbstractFileSystem, path: str, data: bytes, fraction: float, exclusive: bool = False) -> str:
    """A torn write: the first `fraction` of `data` lands at `path`. An exclusive create (a
    manifest's commit) tears only where nothing is: a real conditional put never replaces an
    object, and a fault must never damage a committed checkpoint."""
    kept = int(len(data) * fraction)
    if exclusive and fs.exists(path):
        return ": nothing landed (the object exists: an exclusive create replaces nothing)"
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, bytes(data[:kept]))
    return f": {kept} of {len(data)} bytes landed"


def _faulty(name: str, op: str, index: int, keyword: str):
    def method(self, *args, **kwargs):
        path = args[index] if len(args) > index else kwargs.get(keyword, "")
        return _run(self.plan, op, _path_of(path), lambda: getattr(self.fs, name)(*args, **kwargs))

    method.__name__ = name
    return method


def _passthrough(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.fs, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _path_of(path: object) -> str:
    if isinstance(path, (list, tuple)):
        path = path[0] if path else ""
    text = str(path)
    return text.split("://", 1)[1] if "://" in text else text


class FaultyFileSystem(AbstractFileSystem):
    """`fs` with the faults of `plan` (see module doc); every other attribute is `fs`'s own."""

    cachable = False  # see module doc: a cached instance would leak faults to other callers

    def __init__(self, fs: AbstractFileSystem, plan: StorageFaultPlan):
        super().__init__()
        self.fs = fs
        self.plan = plan
        self.protocol = fs.protocol  # Storage decides local / s3 code paths from it

    def __getattr__(self, name: str):
        # Only reached for attributes the wrapper lacks (s3fs's split_path, call_s3, ...).
        if name in ("fs", "plan"):
            raise AttributeError(name)
        return getattr(self.fs, name)

    @property
    def fsid(self) -> str:
        return self.fs.fsid

    def pipe_file(self, path, value, *args, **kwargs):
        exclusive = kwargs.get("mode") == "create"  # S3's conditional put (Storage.create_exclusive)
        return _run(self.plan, "write", _path_of(path), lambda: self.fs.pipe_file(path, value, *args, **kwargs),
                    lambda fraction: _land_prefix(self.fs, path, value, fraction, exclusive))

    def open(self, path, mode="rb", *args, **kwargs):
        op = "read" if "r" in mode and "+" not in mode else "write"
        verdict = self.plan.judge(op, _path_of(path))
        if verdict.delay_s:
            self.plan.sleep(verdict.delay_s)
        if verdict.fail == "before":
            raise verdict.error(op, _path_of(path))
        handle = self.fs.open(path, mode, *args, **kwargs)
        if verdict.fail is None and verdict.keep_fraction is None:
            return handle
        if op == "read":  # opened, then the reply is lost
            handle.close()
            raise verdict.error(op, _path_of(path), " (the call itself succeeded)")
        return _FaultyWriteFile(handle, verdict, _path_of(path))


for _name, (_op, _index, _keyword) in _OPS.items():
    setattr(FaultyFileSystem, _name, _faulty(_name, _op, _index, _keyword))
for _name in _PASSTHROUGH:
    setattr(FaultyFileSystem, _name, _passthrough(_name))


class _FaultyWriteFile:
    """A file opened for writing whose close tears it or fails after it landed.

    Writes are held until `close`, where only the kept prefix (torn) or everything
    (fail after) is written to the real file, which is then closed, and the error raised.
    An exception inside a `with` block is not ours: the real file handles it as it would.
    """

    def __init__(self, handle, verdict: Verdict, path: str):
        self._handle, self._verdict, self._path = handle, verdict, path
        self._parts: list = []
        self._closed = False

    def write(self, data) -> int:
        # A copy: a caller may reuse its buffer once write returns (shard writes do).
        self._parts.append(data if isinstance(data, str) else bytes(data))
        return len(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        text = any(isinstance(part, str) for part in self._parts)  # a text-mode handle
        data = "".join(self._parts) if text else b"".join(self._parts)
        if self._verdict.keep_fraction is not None:
            kept = int(len(data) * self._verdict.keep_fraction)
            self._land(data[:kept])
            raise self._verdict.error("write", self._path, f": {kept} of {len(data)} bytes landed")
        self._land(data)
        raise self._verdict.error("write", self._path, " (the call itself succeeded)")

    def _land(self, data) -> None:
        """Write `data` to the real file and make it appear at its path, also through a handle that
        publishes only on `commit` (an S3 multipart upload opened with autocommit=False, as
        ckpt.storage's atomic writer does): the fault's bytes land on every backend."""
        self._handle.write(data)
        self._handle.close()
        if getattr(self._handle, "autocommit", True) is False:
            self._handle.commit()
            self._landed = True

    def discard(self) -> None:
        """The writer's clean-up after the fault's error: what landed stays (it is the fault)."""
        if not getattr(self, "_landed", False):
            self._handle.discard()

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.close()
            return False
        self._closed = True
        return self._handle.__exit__(kind, value, traceback)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)  # commit, discard, flush, tell, ...


class Installed:
    """The result of `install`: call it (or leave its `with` block) to undo; `plan` holds the counters."""

    def __init__(self, storage, plan: StorageFaultPlan, wrapper: FaultyFileSystem, original_fs, shadowed):
        self.storage, self.plan = storage, plan
        self._wrapper, self._original_fs, self._shadowed = wrapper, original_fs, shadowed
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        if self.storage.fs is not self._wrapper:
            raise RuntimeError("storage faults must be undone in reverse order of install")
        self.storage.fs = self._original_fs
        for name, previous in self._shadowed.items():
            if previous is None:
                self.storage.__dict__.pop(name, None)
            else:
                self.storage.__dict__[name] = previous
        self._done = True

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc) -> None:
        self()


def install(
    storage, faults: Iterable[FaultSpec | Mapping] | StorageFaultPlan, *, seed: int = 0,
    notify: Callable[[dict], None] | None = None, **plan_options,
) -> Installed:
    """Make `storage` (a ckpt.storage.Storage) suffer `faults`; returns the undo (see module doc).

    `plan_options` go to StorageFaultPlan (`clock`, `sleep`), for tests. Pass a ready
    StorageFaultPlan instead of `faults` to share counters between several storages.
    """
    plan = faults if isinstance(faults, StorageFaultPlan) else StorageFaultPlan(
        faults, seed=seed, notify=notify, **plan_options)
    original_fs = storage.fs
    wrapper = FaultyFileSystem(original_fs, plan)
    shadowed: dict[str, object] = {}
    if storage.is_local:
        for name, make in (("write_immutable", _local_write), ("create_exclusive", _local_create),
                           ("atomic_writer", _local_atomic_writer)):
            shadowed[name] = storage.__dict__.get(name)
            setattr(storage, name, make(plan, original_fs, getattr(storage, name)))
    storage.fs = wrapper
    return Installed(storage, plan, wrapper, original_fs, shadowed)


def install_on(storage, notify: Callable[[dict], None], *, faults: list[ArmedFault], seed: int,
               started: float) -> None:
    """`install` with the rank loop's job clock: the storage setup a rank's checkpoint writer runs.

    Module-level with picklable arguments, so `functools.partial(install_on, faults=..., seed=...,
    started=...)` pickles into a writer process (`ckpt.process_writer`). `started`: the wall time
    of job second 0, which the faults' `at_seconds` count from.
    """
    install(storage, faults, seed=seed, notify=notify, clock=time.time, started=started)


def install_on_data(datasets, notify: Callable[[dict], None], *, faults: list[ArmedFault], seed: int,
                    started: float, gate: Callable[[ArmedFault], bool] | None = None) -> StorageFaultPlan:
    """Make a rank's training datasets (trainer.tokens.reader.TokenDataset) suffer `faults`, its
    `target: data` ones (chaos.config.rank_data_faults), through one plan on the job clock
    (`started`: the wall time of job second 0). Each dataset then reads through the wrapped file
    system's calls, local files too (which it would otherwise map: a fault could not reach those
    reads). Installing again wraps the original file system, not the wrapper. `notify` hears the
    first firing of each fault only: an outage retried for a minute is one notice, not hundreds.
    `gate(fault)`: whether a fault may act yet (StorageFaultPlan)."""
    first: set[int] = set()

    def once(event: dict) -> None:
        if event["fault_id"] not in first:
            first.add(event["fault_id"])
            notify(event)

    plan = StorageFaultPlan(faults, seed=seed, notify=once, clock=time.time, started=started, gate=gate)
    for dataset in datasets:
        original = dataset.fs.fs if isinstance(dataset.fs, FaultyFileSystem) else dataset.fs
        dataset.read_through(FaultyFileSystem(original, plan))
    return plan


def _local_write(plan: StorageFaultPlan, fs: AbstractFileSystem, original: Callable[[str, bytes], None],
                 exclusive: bool = False):
    def write(path: str, data: bytes) -> None:
        _run(plan, "write", path, lambda: original(path, data), lambda f: _land_prefix(fs, path, data, f, exclusive))

    return write


def _local_create(plan: StorageFaultPlan, fs: AbstractFileSystem, original: Callable[[str, bytes], None]):
    return _local_write(plan, fs, original, exclusive=True)


def _local_atomic_writer(plan: StorageFaultPlan, fs: AbstractFileSystem, original):
    # The bytes are collected first and then written as one call, so the plan judges one
    # write per file, as it does for write_immutable.
    @contextlib.contextmanager
    def atomic_writer(path: str) -> Iterator[io.BytesIO]:
        buffer = io.BytesIO()
        yield buffer
        data = buffer.getvalue()

        def write() -> None:
            with original(path) as f:
                f.write(data)

        _run(plan, "write", path, write, lambda fraction: _land_prefix(fs, path, data, fraction))

    return atomic_writer
