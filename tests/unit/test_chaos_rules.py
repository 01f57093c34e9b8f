"""Which storage calls a storage fault fires on: nth, probability, filters, windows, seeds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from chaos.config import FaultSpec
from chaos.storage_rules import StorageFaultPlan

SHARD = "root/job/step-000000020/shard-r00000.bin"
MANIFEST = "root/job/step-000000020/manifest.json"


def _fires(plan: StorageFaultPlan, calls: int, op: str = "write", path: str = SHARD) -> list[int]:
    return [i for i in range(1, calls + 1) if not plan.judge(op, path).clean]


def test_nth_fires_once_or_every_nth_with_repeat():
    assert _fires(StorageFaultPlan([{"kind": "storage_error", "op": "write", "nth": 3}]), 10) == [3]
    every_third = StorageFaultPlan([{"kind": "storage_error", "op": "write", "nth": 3, "repeat": True}])
    assert _fires(every_third, 10) == [3, 6, 9]
    assert _fires(StorageFaultPlan([{"kind": "storage_error", "op": "write"}]), 5) == [1]
    assert _fires(StorageFaultPlan([{"kind": "storage_error", "op": "write", "repeat": True}]), 4) == [1, 2, 3, 4]


def test_probability_is_seeded_and_close_to_its_rate():
    fault = {"kind": "storage_error", "op": "read", "probability": 0.3, "repeat": True}
    runs = [_fires(StorageFaultPlan([fault], seed=seed), 4000, op="read") for seed in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert 0.27 < len(runs[0]) / 4000 < 0.33
    once = _fires(StorageFaultPlan([dict(fault, repeat=False)], seed=1), 100, op="read")
    assert once == runs[0][:1]  # without repeat: the first hit only


def test_filters_by_operation_path_glob_and_step():
    plan = StorageFaultPlan([{"kind": "storage_error", "path": "*/manifest.json", "op": "write", "repeat": True}])
    assert plan.judge("write", SHARD).clean and plan.judge("read", MANIFEST).clean
    assert plan.judge("write", MANIFEST).fail == "before"
    stepped = StorageFaultPlan([{"kind": "storage_error", "at_step": 20, "repeat": True}])
    assert not stepped.judge("delete", SHARD).clean
    assert stepped.judge("delete", SHARD.replace("000000020", "000000021")).clean
    assert stepped.judge("delete", "root/job/step-0000000200/x").clean  # not that step's directory
    shards = StorageFaultPlan([{"kind": "torn_write", "path": "*/shard-*"}])
    assert shards.judge("read", SHARD).clean  # torn_write only tears writes
    assert shards.judge("write", SHARD).keep_fraction == 0.5


def test_active_window_follows_the_clock():
    now = [0.0]
    plan = StorageFaultPlan([{"kind": "storage_latency", "delay_s": 2, "op": "list", "at_seconds": "1m",
                              "duration_s": "30s"}], clock=lambda: now[0])
    seen = []
    for t in (0.0, 59.0, 60.0, 89.0, 90.0, 200.0):
        now[0] = t
        seen.append(plan.judge("list", "root").delay_s)
    assert seen == [0.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    # Anchored at the job's start: built 70 s into the job, it is active at once, for 20 s more.
    late = StorageFaultPlan([{"kind": "storage_error", "op": "list", "repeat": True, "at_seconds": 60,
                              "duration_s": 30}], clock=lambda: now[0], started=1000.0)
    now[0] = 1070.0
    assert late.judge("list", "root").fail == "before"
    now[0] = 1090.0
    assert late.judge("list", "root").clean


def test_first_fault_decides_and_latencies_add_up():
    plan = StorageFaultPlan([
        {"kind": "storage_latency", "delay_s": 1.0, "op": "write"},
        {"kind": "storage_error", "op": "write", "when": "after", "id": 7},
        {"kind": "torn_write", "op": "write"},
        {"kind": "storage_latency", "delay_s": 0.5, "op": "write"},
    ])
    verdict = plan.judge("write", SHARD)
    assert (verdict.delay_s, verdict.fail, verdict.keep_fraction) == (1.5, "after", None)
    assert "fault 7" in str(verdict.error("write", SHARD))
    second = plan.judge("write", SHARD)  # the error fired once; the torn write's first call has passed
    assert (second.delay_s, second.fail, second.keep_fraction) == (1.5, None, None)
    assert [(e["kind"], e["mode"]) for e in plan.fired] == [
        ("storage_latency", "latency"), ("storage_error", "after"), ("storage_latency", "latency")]


def test_other_kinds_are_ignored_and_bad_faults_refused():
    plan = StorageFaultPlan([{"kind": "kill_rank", "rank": 0, "at_step": 3}])
    assert not plan and plan.judge("write", SHARD).clean
    with pytest.raises(ValidationError, match="at most one of nth, probability"):
        StorageFaultPlan([{"kind": "storage_error", "nth": 2, "probability": 0.5}])
    with pytest.raises(ValueError, match="unknown storage operation"):
        plan.judge("append", SHARD)


def test_notify_reports_fault_id_and_mode():
    events = []
    plan = StorageFaultPlan([FaultSpec(kind="storage_error", op="delete")], notify=events.append)
    plan.judge("delete", SHARD)
    assert [(e["type"], e["fault_id"], e["op"], e["path"], e["mode"]) for e in events] == [
        ("fault", 0, "delete", SHARD, "before")]


def test_duration_alone_opens_the_window_at_the_first_matching_call_and_fires_on_every_call_in_it():
    now = [100.0]
    plan = StorageFaultPlan([{"kind": "storage_throttle", "op": "read", "path": "*/shard-*", "duration_s": "10s"}],
                            clock=lambda: now[0])
    assert plan.judge("read", MANIFEST).clean  # not a matching call: the window stays shut
    seen = []
    for t in (150.0, 155.0, 159.9, 160.0, 300.0):  # the first shard read, at 150 s, opens it for 10 s
        now[0] = t
        seen.append(plan.judge("read", SHARD).fail)
    assert seen == ["before", "before", "before", None, None]


def test_a_throttle_fails_like_s3s_503_slowdown_through_s3fs():
    from ckpt.storage_errors import TRANSIENT, classify

    verdict = StorageFaultPlan([{"kind": "storage_throttle", "op": "read"}]).judge("read", SHARD)
    err = verdict.error("read", SHARD)
    assert verdict.fail == "before" and err.errno == 16 and "storage_throttle" in str(err)
    assert err.__cause__.response == {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                                      "ResponseMetadata": {"HTTPStatusCode": 503}}
    assert classify(err) == TRANSIENT
