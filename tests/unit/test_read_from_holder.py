"""A restore reading a shard from a holder that does not answer gives up its turn as soon as it is
stale, not at the holder's time limit: the next generation's restore on the same rank waits for it."""

from __future__ import annotations

import time
import types

import pytest
from ray.exceptions import GetTimeoutError

from orchestrator.rank import snapshots


class _Silent:
    """A holder on a node being lost: its answer never comes."""

    read_held = types.SimpleNamespace(remote=lambda relpath, start, end: "ref")


def _no_answer(monkeypatch):
    def wait(refs, timeout=None):
        time.sleep(min(timeout or 0.0, 0.01))
        return [], refs

    monkeypatch.setattr(snapshots, "ray", types.SimpleNamespace(wait=wait, get=lambda ref: b""))


def test_a_stale_restore_stops_waiting_for_a_silent_holder_at_its_next_check(monkeypatch):
    _no_answer(monkeypatch)
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 3:
            raise RuntimeError("restore call 1 superseded by a later one (2) on this rank")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="superseded"):
        snapshots.read_from_holder(_Silent(), "step-000010/shard-t-r00001.bin", 0, 8, check)
    assert len(checks) == 3 and time.monotonic() - started < 5  # not BUDDY_TIMEOUT_S (60 s)


def test_a_silent_holder_is_given_up_at_the_time_limit(monkeypatch):
    _no_answer(monkeypatch)
    monkeypatch.setattr(snapshots, "BUDDY_TIMEOUT_S", 0.05)
    with pytest.raises(GetTimeoutError, match="did not answer"):
        snapshots.read_from_holder(_Silent(), "step-000010/shard-t-r00001.bin", 0, 8)


def test_a_stale_restore_is_not_taken_for_a_failed_holder(tmp_path):
    from ckpt.held import HeldShards
    from ckpt.peer_storage import PeerStorage
    from orchestrator.rank.restore_turns import RestoreSuperseded

    asked = []

    def remote_read(holder, path, start, end):
        asked.append(holder)
        raise RestoreSuperseded("restore call 1 superseded by a later one (2) on this rank")

    storage = PeerStorage(HeldShards("job"), {"shard-t-r00001.bin": ["first", "second"]}, remote_read)
    with pytest.raises(RestoreSuperseded):
        storage.read_range_into("step-000010/shard-t-r00001.bin", 0, memoryview(bytearray(8)))
    assert asked == ["first"]  # the second holder is not asked: nothing failed there


def test_a_holder_that_failed_a_read_is_not_asked_again_in_that_restore(tmp_path):
    from ckpt.errors import SnapshotUnavailable
    from ckpt.held import HeldShards
    from ckpt.peer_storage import PeerStorage

    asked = []

    def remote_read(holder, path, start, end):
        asked.append((holder, path))
        if holder == "silent":
            raise GetTimeoutError(f"the holder of {path} did not answer within 60 s")
        if holder == "pruned" and path.endswith("r00001.bin"):
            raise FileNotFoundError(path)  # it dropped that one file: it is still asked for others
        return bytes(end - start)

    files = {f"shard-t-r0000{i}.bin": ["silent", "pruned", "buddy"] for i in (1, 2, 3)}
    storage = PeerStorage(HeldShards("job"), files, remote_read)
    for i in (1, 2, 3):
        for start in (0, 8):
            storage.read_range_into(f"step-000010/shard-t-r0000{i}.bin", start, memoryview(bytearray(8)))
    assert [holder for holder, _ in asked].count("silent") == 1  # one timeout, not one per piece
    assert [h for h, p in asked if p.endswith("r00001.bin")] == ["silent", "pruned", "buddy", "pruned", "buddy"]
    assert [h for h, p in asked if p.endswith("r00002.bin")] == ["pruned", "pruned"]
    # With every holder of a file failed, the snapshot is unavailable at once: the controller uses storage.
    lone = PeerStorage(HeldShards("job"), {"shard-t-r00009.bin": ["silent"]}, remote_read)
    with pytest.raises(SnapshotUnavailable, match="did not answer within 60 s"):
        lone.read_range_into("step-000010/shard-t-r00009.bin", 0, memoryview(bytearray(8)))
    with pytest.raises(SnapshotUnavailable, match="failed an earlier read"):
        lone.read_range_into("step-000010/shard-t-r00009.bin", 0, memoryview(bytearray(8)))


def test_chaos_during_restore_fires_on_a_memory_restore_after_the_reads_and_before_the_load():
    from ckpt.held import HeldShards
    from orchestrator.rank.state import load_from_memory
    from tests.unit.test_memory_level import _snapshot
    from trainer.state_slices import TensorSlice

    state, helds, manifest, holders = _snapshot()
    held = HeldShards("job")  # this rank holds every shard: nothing is read from another process
    for relpath in helds[0].files() + helds[2].files():
        held.put(relpath, (helds[0] if helds[0].has(relpath) else helds[2]).read(relpath), 0)
    loaded, fired = [], []

    class Engine:
        def state_slices(self, copy=False):
            return []

        def wanted_slices(self):
            return [TensorSlice(n, t.dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()]

        def load_slices(self, slices, meta):
            loaded.append(len(slices))

    def hook(point, step):
        fired.append((point, step, len(loaded)))
        raise RuntimeError("injected exception at during_restore")

    source = snapshots.MemorySource(12, manifest.model_dump_json(), {file: ["peer"] for file in holders})
    with pytest.raises(RuntimeError, match="injected"):
        load_from_memory(Engine(), source, held, fault_hook=hook)
    assert fired == [("during_restore", 12, 0)] and loaded == []
    load_from_memory(Engine(), source, held)
    assert loaded == [len(state)]
