"""What a rerun carries from its earlier runs, with the fake worker group: their failures (the restart
budget and the crash loop are the job's, not each driver's: orchestrator.controller.failure_carry),
and a goodput snapshot that a run ending before it carried anything does not replace."""

from __future__ import annotations

import json

from ckpt.storage import Storage
from orchestrator.controller.failure_carry import earlier_failures, saved_failures
from orchestrator.controller.ledger_snapshot import SNAPSHOT_FILE
from orchestrator.controller.policies import FailurePolicy, FailureSummary
from orchestrator.wire.store import RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec


def _run(spec, die_at: dict, repeat: bool = False):
    workers = FakeWorkerGroup(RendezvousServer("127.0.0.1"), Storage(spec.checkpoint_root), die_at=die_at)
    workers.repeat = repeat
    lines: list[str] = []
    return _controller(spec, workers, workers.rendezvous, lines).run(), lines


def test_a_rerun_of_a_job_that_spent_its_restarts_fails_at_its_first_failure(tmp_path):
    spec = _spec(tmp_path)  # elastic.max_restarts: 1
    first, _ = _run(spec, {12: 0, 25: 1})
    assert first.status == "failed" and "max_restarts=1" in first.error and first.final_step == 20
    again, _ = _run(spec, {25: 1})  # resumed from step 20 by whatever reran the driver
    assert again.status == "failed" and again.final_step == 20
    assert "2 restarts used in the last 24 h (2 by earlier runs of this job)" in again.error, again.error


def test_a_crash_loop_is_counted_across_reruns(tmp_path):
    spec = _spec(tmp_path, elastic={"max_restarts": 10})
    first, _ = _run(spec, {25: 1}, repeat=True)
    assert "crash loop: rank 1 failed at step 25 3 times" in first.error
    again, _ = _run(spec, {25: 1}, repeat=True)
    assert again.status == "failed" and len(again.failures) == 1, again.error
    assert "crash loop: rank 1 failed at step 25 4 times" in again.error


def test_a_healthy_rerun_keeps_its_budget_and_records_its_own_failures(tmp_path):
    spec = _spec(tmp_path, elastic={"max_restarts": 2})
    first, _ = _run(spec, {12: 0, 25: 1})  # two failures, both restarted: succeeded
    assert first.status == "succeeded"
    saved = json.loads((tmp_path / "ckpt" / "unit" / SNAPSHOT_FILE).read_text())["failures"]
    assert [(f["rank"], f["step"]) for f in saved] == [(0, 12), (1, 25)]


def test_only_failures_a_budget_can_still_count_are_carried():
    policy = FailurePolicy(max_restarts=2, crash_loop_limit=3, window_s=100.0)
    history = [FailureSummary("rank_died", r, 5, "actor died", at=float(r)) for r in range(9)]
    saved = saved_failures(history, policy)
    assert [f["rank"] for f in saved] == [4, 5, 6, 7, 8]  # max_restarts + crash_loop_limit of them
    carried = earlier_failures([*saved, {"at": "soon"}, "garbage", {"rank": 1}], policy, now=106.5)
    assert [f.rank for f in carried] == [7, 8] and all(f.earlier_run for f in carried)  # the window's
    assert earlier_failures({"not": "a list"}, policy, now=0.0) == []


def test_a_parameter_server_rerun_counts_the_repairs_its_earlier_runs_made(tmp_path):
    import time

    import pytest

    from monitor.goodput import GoodputLedger
    from orchestrator.cli.ps_run import carried_budget
    from orchestrator.controller.ledger_snapshot import LedgerSnapshots
    from orchestrator.spec.job_spec import validate_spec
    from paramserver.restart_budget import RestartsSpent

    spec = validate_spec({"name": "ps", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
                          "train": {"steps": 4, "global_batch": 4, "grad_clip": None},
                          "parallel": {"mode": "ps", "dp": 2, "servers": 1},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 2},
                          "elastic": {"max_restarts": 2, "restart_window_s": 3600}})
    snapshots = LedgerSnapshots(Storage(spec.checkpoint_root))
    first = carried_budget(spec, snapshots, snapshots.load())
    now = time.time()
    first.repair(now - 60, "worker 1 replaced")
    snapshots.save(GoodputLedger(), ended=True)  # as the driver does as it ends
    saved = json.loads(Storage(spec.checkpoint_root).read(snapshots.path))
    assert [f["at"] for f in saved["failures"]] == [now - 60]
    saved["failures"].insert(0, {"kind": "repair", "at": now - 7200})  # an earlier run's, out of the window now
    Storage(spec.checkpoint_root).write_immutable(snapshots.path, json.dumps(saved).encode())

    rerun = LedgerSnapshots(Storage(spec.checkpoint_root))
    again = carried_budget(spec, rerun, rerun.load())
    again.repair(now, "server 0 restored")  # the second repair in the window: still within the budget
    with pytest.raises(RestartsSpent, match=r"2 repairs used in the last 3600 s \(1 by earlier runs of this job\)"):
        again.repair(now + 1, "worker 0 replaced")


def test_a_run_that_fails_before_its_first_restore_keeps_the_job_s_goodput_snapshot(tmp_path):
    spec = _spec(tmp_path, elastic={"max_restarts": 3})
    first, _ = _run(spec, {25: 1})
    path = tmp_path / "ckpt" / "unit" / SNAPSHOT_FILE
    before = json.loads(path.read_text())
    workers = FakeWorkerGroup(RendezvousServer("127.0.0.1"), Storage(spec.checkpoint_root),
                              place_error="cluster has 1 CPU")
    report = _controller(spec, workers, workers.rendezvous, []).run()
    assert report.status == "failed" and "1 CPU" in report.error
    after = json.loads(path.read_text())
    assert after["totals"] == before["totals"] and after["time"] == before["time"]  # the job's, not its seconds
    assert [(f["rank"], f["step"]) for f in after["failures"]] == [(1, 25)]  # still carried to the next run


def test_a_parameter_server_driver_that_dies_leaves_its_repairs_and_time_to_the_next_run(tmp_path):
    """The driver's stats poll rewrites the goodput snapshot every few seconds (its own thread), with the
    repairs of the restart budget: a SIGKILLed driver, which never writes its ended snapshot, leaves them."""
    import time
    from types import SimpleNamespace

    from monitor.goodput import GoodputLedger
    from monitor.metrics import JobMetrics
    from orchestrator.cli.ps_run import carried_budget, stats_feed
    from orchestrator.controller.ledger_snapshot import LedgerSnapshots
    from orchestrator.spec.job_spec import validate_spec

    spec = validate_spec({"name": "ps", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
                          "train": {"steps": 4, "global_batch": 4, "grad_clip": None},
                          "parallel": {"mode": "ps", "dp": 2, "servers": 1},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 2},
                          "elastic": {"max_restarts": 5, "restart_window_s": 3600}})
    snapshots = LedgerSnapshots(Storage(spec.checkpoint_root), every_s=0.0, background=True)
    budget = carried_budget(spec, snapshots, None)
    budget.repair(time.time(), "worker 1 replaced")
    feed = stats_feed(SimpleNamespace(on_server_stats=lambda stats: 0), JobMetrics("ps"), GoodputLedger(), None,
                      snapshots)
    feed([])  # a poll: the snapshot is rewritten (no ended one follows: the driver is killed)
    assert snapshots.housekeeper.close(10.0)
    saved = LedgerSnapshots(Storage(spec.checkpoint_root)).load()
    assert saved is not None and not saved["ended"] and len(saved["failures"]) == 1
    assert carried_budget(spec, LedgerSnapshots(Storage(spec.checkpoint_root)), saved).repair_times()
