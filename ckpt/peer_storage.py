"""Read a memory snapshot's shards from the processes that hold them, as if from a store.

A restore from the memory level (docs/design.md, "Two levels") runs the same reader as a
restore from storage (ckpt.reader.read_slices: plan from the manifest, fetch byte ranges,
check every block's CRC, assemble any layout); only the bytes come from elsewhere. The
reader's fetch asks its storage for `path(step_dir, file)` and `read_range_into(path, start,
out)`, and `PeerStorage` answers both: from this process's own `HeldShards` when it holds
the file (its own shard or a buddy's copy: no copy over the network), otherwise from the
first of the file's holders that answers, through `remote_read(holder, relpath, start, end)`
(a Ray call in production, a function in tests).

Protocol: the restoring rank builds one per restore from the controller's `holders` map
(file name -> the holders the controller knows alive) and passes it inside a `Catalog` to
`read_slices` with the snapshot's manifest. When no holder of a file answers, the read raises
`SnapshotUnavailable`: no proof the bytes are bad, and the controller restores from storage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt.errors import ReadAbandoned, SnapshotUnavailable
from ckpt.held import HeldShards

RemoteRead = Callable[[Any, str, int, int], bytes]


class PeerStorage:
    """The read side of `ckpt.storage.Storage` over snapshot holders (see the module docstring)."""

    def __init__(self, held: HeldShards, holders: Mapping[str, Sequence[Any]], remote_read: RemoteRead):
        self.held, self.holders, self.remote_read = held, holders, remote_read
        self.root = "memory-snapshot"
        self.remote_bytes = 0  # bytes that came from other processes
        # Holders that failed a read of this restore, never asked again in it: the reader fetches
        # many pieces, and a silent holder (a spare on a partitioned node) asked for each would cost
        # its timeout each time, until the restore outlived its limit.
        self.failed: set = set()  # their actor ids (a handle deserialised per file is another object)

    def path(self, *parts: str) -> str:
        return "/".join(parts)  # relative: step-XXXXXX/FILE

    def read_range_into(self, path: str, start: int, out: memoryview) -> int:
        if self.held.has(path):
            data = self.held.read_range(path, start, start + len(out))
        else:
            data = self._remote(path, start, start + len(out))
            self.remote_bytes += len(data)
        got = min(len(data), len(out))
        out[:got] = memoryview(data)[:got]
        return len(data)

    def _remote(self, path: str, start: int, end: int) -> bytes:
        file = path.rsplit("/", 1)[-1]
        errors = []
        for holder in self.holders.get(file, ()):
            if _key(holder) in self.failed:
                errors.append("a holder that failed an earlier read of this restore")
                continue
            try:
                return self.remote_read(holder, path, start, end)
            except ReadAbandoned:  # the reader gave up (its restore went stale): no other holder to try
                raise
            except Exception as err:  # that holder died or dropped the file: try the next one
                if not isinstance(err, FileNotFoundError):  # (one file dropped: it may hold the others)
                    self.failed.add(_key(holder))
                errors.append(f"{type(err).__name__}: {str(err)[:200]}")
        raise SnapshotUnavailable(f"no holder of {path} answered ({'; '.join(errors) or 'none known alive'})")


def _key(holder) -> Any:
    """A holder's identity across handles: its Ray actor id (tests pass plain names)."""
    return getattr(holder, "_actor_id", holder)
