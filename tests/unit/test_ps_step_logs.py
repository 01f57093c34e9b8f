"""The parameter-server driver's step logs stay bounded (paramserver.step_logs): past `keep`, the
steps below the last commit fold into their losses and pull waits, which equal the whole logs'."""

from __future__ import annotations

import pytest

from paramserver.actors import StepLog
from paramserver.step_logs import StepLogs, step_losses


def _log(worker: int, step: int) -> StepLog:
    return StepLog(worker, step, loss_sum=10.0 * (step + 1) + worker, tokens=4 + worker, pull_wait_s=0.01 * worker,
                   compute_s=0.1, push_s=0.01, finished_at=float(step))


def _fill(logs: StepLogs, steps: range, workers: int = 2) -> list[StepLog]:
    added = [_log(w, s) for s in steps for w in range(workers)]
    for entry in added:
        logs.add(entry)
    return added


def test_past_keep_the_committed_steps_fold_and_every_loss_and_wait_is_kept():
    logs = StepLogs(2, keep=8)
    whole = _fill(logs, range(0, 6))  # 12 logs, nothing committed: nothing folds
    assert len(logs) == 12 and logs.folded_end == 0
    logs.committed(6)
    assert len(logs) == 4 and logs.folded_end == 4  # whole steps folded, oldest first, down to keep / 2
    whole += _fill(logs, range(6, 12))  # past keep again: steps 4 and 5, below the commit, fold too
    assert logs.folded_end == 6
    assert logs.losses() == pytest.approx(step_losses(whole))
    seconds, count = logs.pull_wait()
    assert count == len(whole) and seconds == pytest.approx(sum(e.pull_wait_s for e in whole))
    assert [(e.worker, e.step) for e in logs.kept()] == sorted((e.worker, e.step) for e in whole if e.step >= 6)


def test_a_job_without_checkpoints_folds_any_finished_step_and_a_restart_drops_them():
    logs = StepLogs(2, keep=4, foldable_below=float("inf"))  # its rollbacks restart at step 0
    whole = _fill(logs, range(0, 10))
    assert len(logs) <= 4 and logs.losses() == pytest.approx(step_losses(whole))
    # An asp worker far ahead: the steps the other has not finished stay whole until it has.
    ahead = [_log(0, s) for s in range(10, 16)]
    for entry in ahead:
        logs.add(entry)
    assert logs.folded_end == 9 and all((0, s) in logs for s in range(10, 16))  # worker 1 is at step 9
    behind = [_log(1, s) for s in range(10, 16)]
    for entry in behind:
        logs.add(entry)
    assert logs.losses() == pytest.approx(step_losses(whole + ahead + behind))
    logs.clear()  # record_rollback's part of a rollback to step 0
    logs.rewind(0)
    assert logs.losses() == [] and logs.folded_end == 0


def test_a_rollback_below_the_folded_steps_drops_their_losses():
    logs = StepLogs(2, keep=8)
    whole = _fill(logs, range(0, 6))
    logs.committed(6)
    for key in [key for key in logs if key[1] >= 2]:  # paramserver.recovery.record_rollback's part
        del logs[key]
    logs.rewind(2)  # an older commit than the last one: the newest went missing
    assert logs.folded_end == 2
    redone = _fill(logs, range(2, 6))
    assert logs.losses() == pytest.approx(step_losses([e for e in whole if e.step < 2] + redone))
    logs.rewind(0)
    assert logs.folded_end == 0 and logs.folded_first is None


def test_a_log_lost_with_its_worker_never_stops_the_folding_and_a_rollback_counts_the_folded_steps():
    # A worker killed after its pushes of step 3 were acknowledged, before its log reached the driver:
    # its replacement resumes at step 4, so (1, 3) never comes. Below the commit the step folds anyway.
    logs = StepLogs(2, keep=8)
    whole = [e for e in _fill(logs, range(0, 8)) if (e.worker, e.step) != (1, 3)]
    del logs[(1, 3)]
    logs.committed(8)
    assert logs.folded_end >= 5 and logs.losses() == pytest.approx(step_losses(whole))
    seconds, count = logs.pull_wait()
    assert count == len(whole) and seconds == pytest.approx(sum(e.pull_wait_s for e in whole))
    folded = logs.folded_end
    for key in list(logs):  # record_rollback's part of a rollback to step 0
        del logs[key]
    assert logs.rewind(0) == sum(1 for e in whole if e.step < folded)  # the folded executions it undid
    assert logs.pull_wait() == (0.0, 0) and logs.losses() == []
