"""Snapshot shards held in a process's memory: a rank's own and the copies it keeps for a buddy.

The memory level of checkpointing (docs/design.md, "Two levels") writes the same shard files
as a storage checkpoint, with the same receipts and per-block CRCs, into an fsspec
`memory://` filesystem, which is per process: the bytes live in the rank's own memory and die
with it. So the rank's `ShardWriter` writes into `HeldShards.storage` exactly as it writes to
a bucket, and a load reads them back through the same planner and the same checks.

Protocol (in one process; thread-safe):
  * The rank's memory writer writes its shard under `storage` (path `step-XXXXXX/FILE`); the
    rank then reads it (`read`) and hands it to its buddy, which stores it with `put`.
  * Any process asks for a byte range of a file it knows the path of (`read_range`): the
    holder answers from whichever copy it has.
  * `prune` after each arrival bounds what is kept: per owner (the rank in the file name) the
    newest `PER_OWNER` snapshots, the newest complete one and the one being built; the step
    `protect` names (the rank loop passes the plan's `memory_complete` at each step) is one of
    them: while a slow buddy copy keeps the newer one incomplete, the snapshot a restore would
    choose stays, beside the newest (the one between gives way: it can no longer complete).
  * `fence(gen)` when the process leaves generation gen - 1 (RankActor.leave: the controller has
    drained that generation's messages, so no snapshot of it can complete any more): from then on
    a shard of an earlier generation is refused (`note_written` and `put` name theirs). A save
    left to finish on its own thread when its rank left (the rank loop's abort settle) lands
    late, and would otherwise sit in one of its owner's `PER_OWNER` places, at a step the new
    generation redoes, and push out the complete snapshot a restore is about to read, or later
    the new generation's newest complete one.
  * `keep_only(files, gen)` when generation `gen` restores: what it restores from stays, the rest
    goes; the fence rises to `gen` too. What it kept stays while it is `protected` (the newest
    complete snapshot until `gen` completes one), and goes at the first arrival after.
"""

from __future__ import annotations

import contextlib
import re
import threading
import uuid
from collections.abc import Iterable

from ckpt.manifest import parse_step_dir
from ckpt.storage import Storage

PER_OWNER = 2  # the newest complete snapshot and the one being built
_OWNER = re.compile(r"-r(\d+)\.bin$")


class HeldShards:
    """Shard files of memory snapshots in this process, under one `memory://` root per instance."""

    def __init__(self, job: str):
        # A root of its own: the memory filesystem is shared by everything in the process.
        self.storage = Storage(f"memory://undying-held/{job}-{uuid.uuid4().hex[:8]}")
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, int]] = {}  # relative path -> (bytes, generation that took it)
        self.gen = -1  # the fence (`fence`, `keep_only`): shards of generations before it are stale
        self.protected: int | None = None  # the controller's newest complete snapshot (`protect`)

    def path(self, relpath: str) -> str:
        return self.storage.path(relpath)

    def note_written(self, relpath: str, gen: int) -> bool:
        """The rank's own writer of generation `gen` finished `relpath` (written through `storage`);
        False when that generation is over here: the file is dropped."""
        return self._hold(relpath, self.storage.fs.info(self.path(relpath))["size"], gen)

    def put(self, relpath: str, data: bytes, gen: int) -> bool:
        """Keep a buddy's copy of `relpath`, taken in generation `gen`; False when that generation is over here."""
        self.storage.write_immutable(self.path(relpath), data)
        return self._hold(relpath, len(data), gen)

    def _hold(self, relpath: str, size: int, gen: int) -> bool:
        with self._lock:  # the same lock as keep_only's generation: a late file is either listed there or refused here
            stale = gen < self.gen
            if not stale:
                self._files[relpath] = (size, gen)
        if stale:
            self._drop([relpath])
            return False
        self.prune()
        return True

    def has(self, relpath: str) -> bool:
        with self._lock:
            return relpath in self._files

    def read(self, relpath: str) -> bytes:
        return self.storage.read(self.path(relpath))

    def read_range(self, relpath: str, start: int, end: int) -> bytes:
        if not self.has(relpath):
            raise FileNotFoundError(f"{relpath} is not held here")
        return self.storage.read_range(self.path(relpath), start, end)

    def nbytes(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._files.values())

    def files(self) -> list[str]:
        with self._lock:
            return sorted(self._files)

    def protect(self, step: int | None) -> None:
        """Keep snapshot `step` (the controller's newest complete one) whatever newer ones arrive."""
        self.protected = step

    def prune(self) -> None:
        """Per owner rank, keep the files of its `PER_OWNER` newest snapshot steps, `protected` among them.
        A file an earlier generation took goes unless it is `protected`: its owner's rank number may
        have gone with a shrink (the ranks were renumbered), and no file of that owner would ever
        arrive again to push it out."""
        with self._lock:
            taken_in = {relpath: gen for relpath, (_, gen) in self._files.items()}
        current = [r for r, gen in taken_in.items() if gen >= self.gen or _step_and_owner(r)[0] == self.protected]
        by_owner: dict[int, set[int]] = {}
        for relpath in current:
            step, owner = _step_and_owner(relpath)
            by_owner.setdefault(owner, set()).add(step)
        keep = {(step, owner) for owner, steps in by_owner.items() for step in self._kept(sorted(steps))}
        self._drop(r for r in taken_in if r not in current or _step_and_owner(r) not in keep)

    def _kept(self, steps: list[int]) -> list[int]:
        """Of one owner's snapshot steps, oldest first: the newest PER_OWNER, or, when `protected` is
        older than those, it and the newest PER_OWNER - 1 (still PER_OWNER: the memory budget's)."""
        if self.protected not in steps or self.protected in steps[-PER_OWNER:]:
            return steps[-PER_OWNER:]
        return [self.protected, *steps[-(PER_OWNER - 1):]]

    def fence(self, gen: int) -> None:
        """Refuse shards of generations before `gen` from now on."""
        with self._lock:
            self.gen = max(self.gen, gen)

    def keep_only(self, files: Iterable[str], gen: int) -> None:
        """Keep `files` alone, and refuse shards of generations before `gen` (a restore, before any writer
        of `gen` starts). Files no writer noted go too: an abandoned save's, whose whole file memory://
        wrote after its last check, would otherwise stay in the process for its life."""
        keep = set(files)
        self.fence(gen)
        # What a restore reads is the newest complete snapshot until `gen` completes one: protected before
        # the rank loop's first `protect` (a buddy copy may arrive first), or nothing is (a storage restore).
        steps = {_step_and_owner(relpath)[0] for relpath in keep}
        self.protected = steps.pop() if len(steps) == 1 else None
        # The store's own keys: a listing may race another thread's delete (a stale buddy copy dropped).
        prefix = self.storage.root + "/"
        written = {key[len(prefix):] for key in list(self.storage.fs.store) if key.startswith(prefix)}
        self._drop(r for r in set(self.files()) | written if r not in keep)

    def _drop(self, relpaths: Iterable[str]) -> None:
        directories = set()
        for relpath in list(relpaths):
            with self._lock:
                self._files.pop(relpath, None)
            with contextlib.suppress(FileNotFoundError):
                self.storage.fs.rm(self.path(relpath))
            directories.add(relpath.partition("/")[0])
        # The memory filesystem keeps a directory until it is removed and scans all of them on
        # every lookup: a rank snapshotting every few steps for days would slow each snapshot.
        # A directory still in use (a file held, or one being written) refuses, and stays.
        for directory in directories:
            with contextlib.suppress(OSError):
                self.storage.fs.rmdir(self.path(directory))


def _step_and_owner(relpath: str) -> tuple[int, int]:
    """(step, owner rank) of `step-XXXXXX/shard-...-rNNNNN.bin`."""
    directory, _, name = relpath.partition("/")
    step, owner = parse_step_dir(directory), _OWNER.search(name)
    if step is None or owner is None:
        raise ValueError(f"{relpath!r} is not a snapshot shard path (step-XXXXXX/shard-...-rNNNNN.bin)")
    return step, int(owner.group(1))
