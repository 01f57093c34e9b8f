"""The work a rollback throws away (orchestrator.controller.lost_work): booked against the step a
recovery expects, then topped up when the restore lands older (a corrupt newest commit, a memory
snapshot that failed to load, nothing left to load)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from monitor.goodput import GoodputLedger
from orchestrator.controller.lost_work import LostWork


def _setup():
    # 0.5 s of compute per step; a rollback of the failed generation to step P costs 2 s.
    record = SimpleNamespace(rolled_back_seconds=lambda point, since, failed_at: 2.0,
                             work_seconds=lambda first, end: 0.5 * (end - first))
    ledger = GoodputLedger(carried={"productive": 100.0})
    return LostWork(record, ledger), ledger


def _failure():
    return SimpleNamespace(onset=1.0, record=SimpleNamespace(lost_work_s=None))


def test_a_restore_at_the_expected_step_books_nothing_more():
    lost, ledger = _setup()
    failure = _failure()
    assert lost.on_failure(failure, 20, trained_since=0.0) == 2.0
    assert lost.on_restored(failure, 20) == ""
    assert failure.record.lost_work_s == 2.0 and ledger.totals()["lost_work"] == pytest.approx(2.0)


def test_a_restore_older_than_expected_books_the_steps_between():
    lost, ledger = _setup()
    failure = _failure()
    lost.on_failure(failure, 20, trained_since=0.0)
    words = lost.on_restored(failure, 10)
    assert words == "; older than step 20 the recovery expected: 5.00 s more work to redo"
    assert failure.record.lost_work_s == pytest.approx(7.0)
    assert ledger.totals()["lost_work"] == pytest.approx(7.0)
    assert lost.on_restored(failure, 10) == ""  # booked once: the next restore starts a new account


def test_a_failed_restore_keeps_the_oldest_step_booked_to_and_a_fresh_start_books_from_zero():
    lost, ledger = _setup()
    died, restore_failed = _failure(), _failure()
    lost.on_failure(died, 30, trained_since=0.0)  # a memory snapshot at 30 expected
    # Its load failed: the next recovery trained nothing and expects the newest commit, step 20.
    assert lost.on_failure(restore_failed, 20, trained_since=None) == 0.0
    lost.on_restored(restore_failed, None)  # nothing loads: a fresh start redoes steps 0..29
    assert restore_failed.record.lost_work_s == pytest.approx(0.5 * 30)
    assert ledger.totals()["lost_work"] == pytest.approx(2.0 + 15.0)


def test_the_failure_records_the_lost_work_the_ledger_booked_not_more():
    record = SimpleNamespace(rolled_back_seconds=lambda point, since, failed_at: 5.0, work_seconds=lambda a, b: 0.0)
    ledger = GoodputLedger(carried={"productive": 1.5})  # less productive time than the rollback's estimate
    failure = _failure()
    assert LostWork(record, ledger).on_failure(failure, 20, trained_since=0.0) == pytest.approx(1.5)
    assert failure.record.lost_work_s == pytest.approx(1.5) == ledger.totals()["lost_work"]
