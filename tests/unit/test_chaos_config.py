"""The `chaos:` section's new fields: durations, random-failure settings, storage-fault selectors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from chaos.config import (
    CONTROLLER_POINTS,
    FAULT_POINTS,
    INJECTABLE_KINDS,
    LIBRARY_KINDS,
    RANK_POINTS,
    ChaosConfig,
    FaultSpec,
    support_problems,
)
from chaos.durations import parse_duration


def _error(model, data) -> tuple[tuple, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    [error] = info.value.errors()
    return error["loc"], error["msg"]


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("1.5h", 5400.0),
                                                ("250ms", 0.25), ("45", 45.0), (" 2 m ", 120.0), ("1d", 86400.0)])
def test_durations_parse(text, seconds):
    assert parse_duration(text) == seconds
    if seconds >= 1:
        assert ChaosConfig(mtbf_s=text).mtbf_s == seconds


def test_numbers_still_work_and_bad_durations_name_field_and_fix():
    assert ChaosConfig(mtbf_s=90).mtbf_s == 90.0
    assert FaultSpec(kind="kill_controller", at_seconds="5m").at_seconds == 300.0
    loc, msg = _error(ChaosConfig, {"mtbf_s": "30 minutes"})
    assert loc == ("mtbf_s",) and "'30 minutes' is not a duration" in msg and "'2m'" in msg
    loc, msg = _error(ChaosConfig, {"mtbf_s": "0s"})
    assert loc == ("mtbf_s",) and "greater than 0" in msg
    loc, msg = _error(ChaosConfig, {"mtbf_s": "250ms"})  # a day of such failures is drawn at placement
    assert loc == ("mtbf_s",) and "0.25 s is below 1 s per target" in msg and "give at least '1s'" in msg
    loc, msg = _error(FaultSpec, {"kind": "storage_latency", "op": "read", "delay_s": "soon"})
    assert loc == ("delay_s",) and "not a duration" in msg


def test_random_failure_fields():
    chaos = ChaosConfig(mtbf_s="1h", mtbf_kind="kill_rank", mtbf_start_s="2m", mtbf_max_faults=3, seed=5)
    assert (chaos.mtbf_s, chaos.mtbf_kind, chaos.mtbf_start_s, chaos.mtbf_max_faults) == (3600.0, "kill_rank", 120.0, 3)
    loc, msg = _error(ChaosConfig, {"mtbf_kind": "kill_rank"})
    assert loc == ("mtbf_kind",) and "need mtbf_s" in msg and "remove it" in msg
    loc, msg = _error(ChaosConfig, {"mtbf_s": "1h", "mtbf_kind": "slow_rank"})
    assert loc == ("mtbf_kind",)
    loc, _ = _error(ChaosConfig, {"mtbf_s": "1h", "mtbf_rate": 2})
    assert loc == ("mtbf_rate",)  # extra="forbid": a typo is an error, not a silently ignored key
    # A dumped config (every key present, defaults included) validates again.
    assert ChaosConfig.model_validate(ChaosConfig().model_dump()) == ChaosConfig()


@pytest.mark.parametrize(
    ("fault", "loc", "fragment"),
    [
        ({"kind": "kill_rank", "rank": 0, "at_step": 1, "op": "write"}, ("op",), "storage faults"),
        ({"kind": "storage_latency", "delay_s": 1, "when": "after"}, ("when",), "storage_error only"),
        ({"kind": "storage_error", "keep_fraction": 0.5}, ("keep_fraction",), "torn_write only"),
        ({"kind": "torn_write", "op": "read"}, ("op",), "use op: write"),
        ({"kind": "storage_error", "nth": 2, "probability": 0.1}, (), "at most one of nth, probability"),
        ({"kind": "storage_error", "nth": 0}, ("nth",), "greater than or equal to 1"),
        ({"kind": "storage_error", "probability": 1.5}, ("probability",), "less than or equal to 1"),
        ({"kind": "storage_error"}, (), "give a trigger"),
        ({"kind": "torn_write", "target": "data"}, ("target",), "training data is only read"),
        ({"kind": "storage_throttle", "target": "data", "at_point": "before_step"}, (), "remove at_point"),
        ({"kind": "storage_error", "target": "data", "op": "write"}, (), "any op other than read"),
        ({"kind": "kill_rank", "rank": 0, "at_step": 1, "target": "data"}, ("target",), "storage faults"),
        ({"kind": "storage_error", "target": "disk"}, ("target",), "'checkpoint' or 'data'"),
    ],
)
def test_storage_fault_checks(fault, loc, fragment):
    got_loc, msg = _error(FaultSpec, fault)
    assert got_loc == loc and fragment in msg, msg


def test_slow_rank_takes_a_factor_or_a_fixed_delay():
    assert FaultSpec(kind="slow_rank", rank=0, at_step=0, delay_s="1m").delay_s == 60.0
    assert FaultSpec(kind="slow_rank", rank=0, at_step=0, factor=2.0).factor == 2.0
    for both_or_neither in ({"factor": 2.0, "delay_s": 60}, {}):
        _, msg = _error(FaultSpec, {"kind": "slow_rank", "rank": 0, "at_step": 0, **both_or_neither})
        assert "needs factor" in msg and "delay_s" in msg and "not both" in msg, msg


def test_storage_selectors_are_a_trigger():
    fault = FaultSpec(kind="storage_error", op="write", path="*/manifest.json", when="after")
    assert (fault.op, fault.path, fault.when, fault.nth) == ("write", "*/manifest.json", "after", None)
    assert FaultSpec(kind="torn_write", path="*/shard-*", keep_fraction=0.1).keep_fraction == 0.1


def test_every_library_kind_is_injectable():
    assert INJECTABLE_KINDS == LIBRARY_KINDS
    assert {"nan_grad", "storage_error", "storage_latency", "torn_write", "corrupt_shard",
            "kill_controller"} <= INJECTABLE_KINDS
    assert set(RANK_POINTS) & set(CONTROLLER_POINTS) == set()
    assert {"in_allreduce", "during_restore", "before_manifest_commit", "after_manifest_commit"} <= set(FAULT_POINTS)


@pytest.mark.parametrize(
    ("fault", "field", "fragment"),
    [
        ({"kind": "nan_grad", "rank": 0, "at_step": 3}, None, ""),
        ({"kind": "nan_grad", "rank": 0, "at_step": 3, "at_point": "after_backward"}, None, ""),
        ({"kind": "nan_grad", "rank": 0, "at_point": "before_step"}, "at_point", "only after the backward"),
        ({"kind": "nan_grad", "rank": 0, "at_seconds": 5}, "at_seconds", "time-triggered nan_grad"),
        ({"kind": "raise", "rank": 0, "at_step": 3, "duration_s": 5}, "duration_s", "storage faults only"),
        ({"kind": "kill_rank", "rank": 0, "at_seconds": 5}, None, ""),
        ({"kind": "storage_error", "path": "*/manifest.json", "when": "after"}, None, ""),
        ({"kind": "storage_error", "op": "list", "at_seconds": 5, "duration_s": 2}, None, ""),
        ({"kind": "storage_latency", "rank": 1, "delay_s": 0.5, "at_step": 10}, None, ""),
        ({"kind": "torn_write", "rank": 1, "at_step": 10}, None, ""),
        ({"kind": "storage_error", "rank": 1, "op": "read"}, None, ""),
        ({"kind": "storage_throttle", "rank": 1, "op": "read", "duration_s": 10}, None, ""),
        ({"kind": "storage_throttle", "target": "data", "at_seconds": 20, "duration_s": 15}, None, ""),
        ({"kind": "storage_throttle", "target": "data", "at_step": 60, "duration_s": 15}, None, ""),
        ({"kind": "storage_error", "target": "data", "rank": 1, "op": "read", "at_seconds": 5}, None, ""),
        ({"kind": "storage_error", "rank": 1, "op": "list"}, "op", "restore reads (op: read)"),
        ({"kind": "storage_error", "rank": 1, "op": "read", "at_seconds": 5}, "at_seconds", "remove at_seconds"),
        ({"kind": "storage_error", "at_point": "during_shard_write"}, "at_point", "not by a fault point"),
        ({"kind": "corrupt_shard", "at_step": 20}, None, ""),
        ({"kind": "corrupt_shard", "at_point": "during_stage"}, "at_point", "remove at_point"),
        ({"kind": "corrupt_shard", "at_seconds": 5}, "at_seconds", "remove at_seconds"),
        ({"kind": "corrupt_shard", "rank": 1, "at_step": 20}, "rank", "remove rank"),
        ({"kind": "corrupt_shard", "at_step": 20, "repeat": True}, "repeat", "remove repeat"),
        # Points: rank kinds at rank points, kill_controller at controller points (or at_step alone).
        ({"kind": "kill_rank", "rank": 0, "at_point": "in_allreduce"}, None, ""),
        ({"kind": "hang_rank", "rank": 1, "at_step": 20, "at_point": "during_restore"}, None, ""),
        ({"kind": "kill_rank", "rank": 0, "at_point": "before_manifest_commit"}, "at_point",
         "only kill_controller fires"),
        ({"kind": "raise", "rank": 0, "at_point": "no_such_point"}, "at_point", "unknown fault point"),
        ({"kind": "kill_rank", "rank": 0, "at_point": "After_Backward"}, "at_point",
         "unknown fault point 'After_Backward' (did you mean 'after_backward'?); use one of before_step"),
        ({"kind": "kill_controller", "at_step": 12}, None, ""),
        ({"kind": "kill_controller", "at_point": "before_manifest_commit"}, None, ""),
        ({"kind": "kill_controller", "at_point": "after_manifest_commit", "at_step": 20}, None, ""),
        ({"kind": "kill_controller", "at_point": "after_backward"}, "at_point",
         "not at a rank point; use at_point: before_manifest_commit or after_manifest_commit"),
        ({"kind": "kill_controller", "at_point": "ckpt.commit"}, "at_point", "unknown point 'ckpt.commit'"),
        ({"kind": "kill_controller", "at_seconds": 5}, "at_seconds", "remove at_seconds"),
        ({"kind": "kill_controller", "node": "n1", "at_step": 5}, "node", "remove node"),
        ({"kind": "kill_rank", "rank": 1, "at_step": 5, "factor": 3.0}, "factor",
         "factor applies to slow_rank faults only; remove factor from this kill_rank fault"),
        ({"kind": "hang_rank", "rank": 1, "at_step": 5, "delay_s": 2}, "delay_s",
         "delay_s applies to slow_rank and storage_latency faults only"),
        ({"kind": "kill_rank", "rank": 1, "at_step": 5, "message": "boom"}, "message", "applies to raise faults only"),
        ({"kind": "kill_controller", "at_step": 5, "repeat": True}, "repeat", "fires once per job"),
        # A scripted kill_node names its node by a rank it hosts; only the random schedule uses node.
        ({"kind": "kill_node", "rank": 1, "at_step": 5}, None, ""),
        ({"kind": "kill_node", "node": "10.0.0.7", "at_step": 5}, "node", "give rank: <r>"),
        ({"kind": "kill_node", "rank": 1, "node": "10.0.0.7", "at_step": 5}, "node", "and remove node"),
    ],
)
def test_support_problems_name_the_trigger_a_kind_does_not_take(fault, field, fragment):
    problems = support_problems(ChaosConfig(faults=[FaultSpec(**fault)]))
    if field is None:
        assert problems == []
    else:
        [(got, message)] = problems
        assert got == f"chaos.faults[0].{field}" and fragment in message, message
