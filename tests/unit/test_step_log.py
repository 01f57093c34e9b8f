"""The controller's per-step records in columns: a dict's behaviour at a sixth of its memory."""

from __future__ import annotations

import math
import tracemalloc

import pytest

from orchestrator.controller.step_log import StepLog, StepRecord


def test_records_read_back_in_step_order_and_a_redone_step_replaces_its_record():
    log = StepLog()
    for step in (5, 6, 7, 8):  # a job resumed after step 4: the steps before were never recorded
        log.put(StepRecord(step, 2.0 - step / 10, 4096, 0.1, 1000.0 + step, 0.01))
    log.put(StepRecord(7, 1.25, 2048, 0.2, 2000.0))  # redone after a rollback
    assert len(log) == 4 and list(log) == [5, 6, 7, 8] and 4 not in log and 9 not in log and "7" not in log
    assert log[7] == StepRecord(7, 1.25, 2048, 0.2, 2000.0, 0.0)
    assert [r.step for r in log.records(7)] == [7, 8] and log.newest() == 8
    assert log.totals() == (pytest.approx(0.5), 4096 * 3 + 2048)
    assert log.get(3) is None and dict(log.items())[5].loss == 1.5
    with pytest.raises(KeyError):
        log[4]
    log.put(StepRecord(2, math.nan, 1, 0.1, 0.0))  # NaN losses are real: kept as they are
    assert math.isnan(log[2].loss) and log.newest() == 8 and len(log) == 5


def test_an_empty_log_and_a_negative_step():
    log = StepLog()
    assert not log and log.newest() is None and log.totals() == (0.0, 0) and list(log.records()) == []
    with pytest.raises(ValueError, match="numbered from 0"):
        log.put(StepRecord(-1, 1.0, 1, 0.1, 0.0))


def test_a_hundred_thousand_steps_take_under_60_bytes_each():
    tracemalloc.start()
    log = StepLog()
    for step in range(100_000):
        log.put(StepRecord(step, 2.0, 4096, 0.1, 1.7e9 + step, 0.0))
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held / 100_000 < 60, held


def test_a_job_resumed_at_a_high_step_holds_no_columns_for_the_steps_before():
    log = StepLog()
    log.put(StepRecord(900_000, 2.0, 1, 0.1, 5.0))
    log.put(StepRecord(900_002, 1.9, 1, 0.1, 6.0))
    assert list(log) == [900_000, 900_002] and 900_001 not in log and 0 not in log
    assert len(log._present) == 3  # columns from the first step recorded on
    # A fallback to a checkpoint older than the one this controller resumed from: steps before it.
    log.put(StepRecord(899_998, 2.1, 1, 0.1, 7.0))
    assert list(log) == [899_998, 900_000, 900_002] and log[900_000].time == 5.0 and log[899_998].loss == 2.1
    assert [r.step for r in log.records(899_999)] == [900_000, 900_002] and log.newest() == 900_002
    assert log.totals() == (pytest.approx(0.3), 3)
