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
