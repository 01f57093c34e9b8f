"""End-of-run invariant checks: each one passes on a good run and fails, naming the problem, on a bad one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from chaos.corrupt import corrupt_shard
from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.shards import write_shard
from ckpt.storage import Storage
from monitor.goodput import GoodputLedger
from orchestrator.cli.chaos.invariants import (
    check_all,
    check_checkpoints_verify,
    check_data_once,
    check_goodput,
    check_model_matches,
    check_newest_loads,
    check_no_process_left,
)
from orchestrator.controller.step_history import Restored, StepRecord, record_step, surviving_history


def _save(catalog: Catalog, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    receipts = [write_shard(catalog.storage, step, 0, {"w": torch.randn(32, 8, generator=g)}, blocking_s=0.0),
                write_shard(catalog.storage, step, 1, {"b": torch.randn(8, generator=g)}, blocking_s=0.0)]
    catalog.commit(job="j", step=step, generation=0, layout={"dp": 2}, spec_hash="h", receipts=receipts,
                   state={"engine": {"next_step": step}})


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    cat = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    for step in (10, 20, 30):
        _save(cat, step)
    return cat


# -- (a) and (b): checkpoints ------------------------------------------------------------------


def test_checkpoints_verify_names_the_bad_ones(catalog):
    assert check_checkpoints_verify(catalog).ok
    corrupt_shard(catalog.storage, 20, seed=0)
    check = check_checkpoints_verify(catalog)
    assert not check.ok and "step 20" in check.detail and "CorruptCheckpoint" in check.detail
    assert "step 10" not in check.detail and "step 30" not in check.detail
    # Corrupted on purpose: it must fail to verify, and then the check passes.
    assert check_checkpoints_verify(catalog, expected_bad=[20]).ok
    missed = check_checkpoints_verify(catalog, expected_bad=[20, 30])
    assert not missed.ok and "corrupted on purpose but verifies: steps 30" in missed.detail


def test_newest_loads(catalog, tmp_path):
    assert check_newest_loads(catalog).ok and "step 30" in check_newest_loads(catalog).detail
    catalog.storage.remove(catalog.storage.path(step_dir(30), "shard-r00001.bin"))
    broken = check_newest_loads(catalog)
    assert not broken.ok and "step 30" in broken.detail
    assert check_newest_loads(catalog, expected_bad=[30]).ok  # the newest one not corrupted on purpose: 20
    empty = check_newest_loads(Catalog(Storage(f"file://{tmp_path}/empty")))
    assert not empty.ok and "no committed checkpoint" in empty.detail


# -- (c): final model against the reference ------------------------------------------------------


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(16, 4, generator=g), "model/b": torch.zeros(4), "optim/step": torch.tensor(7.0)}


def test_model_matches_bit_for_bit_or_names_the_worst_tensor():
    reference = _model()
    assert check_model_matches({k: v.clone() for k, v in reference.items()}, reference).ok
    final = {k: v.clone() for k, v in reference.items()}
    final["model/w"][3, 1] = torch.nextafter(final["model/w"][3, 1], torch.tensor(10.0))  # one ulp
    final["model/b"][0] = 1e-3
    check = check_model_matches(final, reference)
    assert not check.ok and "2 of 3 tensors differ (bit for bit)" in check.detail
    assert "worst model/b: max |diff| 0.001" in check.detail
    close = check_model_matches(final, reference, exact=False, rtol=1e-5, atol=1e-2)
    assert close.ok and "worst model/b" in close.detail
    assert not check_model_matches(final, reference, exact=False, rtol=1e-5, atol=1e-4).ok


def test_model_matches_catches_signed_zero_nan_names_and_dtypes():
    reference = _model()
    signed = dict(reference, **{"model/b": -reference["model/b"]})  # -0.0: equal values, other bits
    assert not check_model_matches(signed, reference).ok
    assert check_model_matches(signed, reference, exact=False).ok
    poisoned = dict(reference, **{"model/w": reference["model/w"].clone().fill_(float("nan"))})
    nan_check = check_model_matches(poisoned, reference, exact=False)
    assert not nan_check.ok and "worst model/w: max |diff| inf" in nan_check.detail
    missing = check_model_matches({k: v for k, v in reference.items() if k != "optim/step"}, reference)
    assert not missing.ok and "missing optim/step" in missing.detail
    cast = check_model_matches(dict(reference, **{"model/b": reference["model/b"].double()}), reference)
    assert not cast.ok and "model/b torch.float64[4] vs torch.float32[4]" in cast.detail


# -- (d): every sample of every step exactly once -------------------------------------------------


def _run_with_a_failure() -> list:
    # dp4 for steps 0..24, a failure, restore from the checkpoint at 20, then dp2 to the end.
    return [StepRecord(s, 4) for s in range(25)] + [Restored(20)] + [StepRecord(s, 2) for s in range(20, 60)]


def test_data_once_passes_across_a_restore_and_a_layout_change():
    events = _run_with_a_failure()
    survived = surviving_history(events)
    assert [r.step for r in survived] == list(range(60)) and survived[20].dp_size == 2
    check = check_data_once(events, final_step=60, global_batch=8)
    assert check.ok and "dp sizes [2, 4]" in check.detail
    assert check_data_once([(0, 1), (1, 2, [[0, 1, 2, 3], [4, 5, 6, 7]])], final_step=2, global_batch=8).ok


def test_stored_history_is_runs_and_keeps_what_the_check_needs():
    stored: list = []
    for step in range(25):
        record_step(stored, step, 4)
    stored.append(["restore", 20])
    for step in range(20, 60):
        record_step(stored, step, 2 if step < 40 else 4)  # a grow back to dp4 at step 40
    assert stored == [["steps", 0, 25, 4], ["restore", 20], ["steps", 20, 40, 2], ["steps", 40, 60, 4]]
    assert surviving_history(stored) == surviving_history(_run_with_a_failure()[:46] + [
        StepRecord(s, 4) for s in range(40, 60)])
    assert check_data_once(stored, final_step=60, global_batch=8).ok
    # A step run again without a restore starts a new run: the repeat is still seen.
    replayed: list = []
    for step in [*range(10), *range(8, 12)]:
        record_step(replayed, step, 4)
    assert replayed == [["steps", 0, 10, 4], ["steps", 8, 12, 4]]
    check = check_data_once(replayed, final_step=12, global_batch=8)
    assert not check.ok and "steps applied twice: 8, 9" in check.detail


def test_data_once_fails_on_skipped_repeated_or_wrong_steps():
    skipped = [StepRecord(s, 4) for s in range(25)] + [Restored(20)] + [StepRecord(s, 2) for s in range(21, 60)]
    check = check_data_once(skipped, final_step=60, global_batch=8)
    assert not check.ok and "steps never applied: 20" in check.detail
    replayed = [StepRecord(s, 4) for s in range(25)] + [StepRecord(s, 4) for s in range(20, 60)]  # no restore
    check = check_data_once(replayed, final_step=60, global_batch=8)
    assert not check.ok and "steps applied twice: 20, 21, 22, 23, 24" in check.detail
    beyond = check_data_once([StepRecord(s, 1) for s in range(3)], final_step=2, global_batch=8)
    assert not beyond.ok and "outside 0..final-1: 2" in beyond.detail
    bad_samples = [(0, 2, [[0, 1, 2, 3], [3, 4, 5, 6]])]  # sample 3 twice, 7 never
    check = check_data_once(bad_samples, final_step=1, global_batch=8)
    assert not check.ok and "repeated samples 3" in check.detail and "skipped 7" in check.detail
    uneven = check_data_once([StepRecord(0, 3)], final_step=1, global_batch=8)  # 8 samples do not split over 3
    assert not uneven.ok and "step 0 (dp=3" in uneven.detail


# -- (e): goodput ---------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_goodput_sums_to_wall():
    clock = _Clock()
    ledger = GoodputLedger(clock=clock)
    for bucket, seconds in (("productive", 30.0), ("detection", 2.5), ("productive", 10.0)):
        ledger.enter(bucket)
        clock.now += seconds
    ledger.move(4.0, "productive", "lost_work")
    ledger.stop()
    check = check_goodput(ledger)
    assert check.ok and "42.500 s booked of 42.500 s wall" in check.detail and "goodput 84.7%" in check.detail
    assert check_goodput(ledger.to_dict(), wall_s=ledger.wall()).ok


def test_goodput_fails_on_a_gap_a_negative_or_an_unknown_bucket():
    totals = {"productive": 30.0, "detection": 2.0}
    gap = check_goodput(totals, wall_s=35.0)
    assert not gap.ok and "off by -3.000000 s" in gap.detail
    assert not check_goodput({"productive": 40.0, "lost_work": -5.0}, wall_s=35.0).ok
    unknown = check_goodput({"productive": 30.0, "coffee": 5.0}, wall_s=35.0)
    assert not unknown.ok and "unknown buckets ['coffee']" in unknown.detail
    assert not check_goodput({"productive": float("nan")}, wall_s=1.0).ok
    assert not check_goodput(totals).ok  # a dict has no wall of its own


def _report_of(ledger: GoodputLedger):
    from monitor.report import GoodputSummary

    summary = GoodputSummary.from_ledger(ledger)
    return summary, {"productive": summary.productive_s, **summary.badput_s}


def test_wrong_buckets_fail_against_the_ledgers_clock_not_against_their_own_sum():
    from orchestrator.cli.chaos.experiment import check_wall_within

    clock = _Clock()
    ledger = GoodputLedger(clock=clock)
    ledger.enter("productive")
    clock.now += 30.0
    ledger.stop()
    summary, buckets = _report_of(ledger)
    assert summary.clock_wall_s == 30.0 and check_goodput(buckets, wall_s=summary.clock_wall_s).ok
    ledger._booked["productive"] += 5.0  # a booking bug: 5 s counted twice
    summary, buckets = _report_of(ledger)
    assert check_goodput(buckets, wall_s=summary.wall_s).ok  # the report's wall is their sum: blind
    check = check_goodput(buckets, wall_s=summary.clock_wall_s)
    assert not check.ok and "buckets sum to 35.000000 s but wall is 30.000000 s" in check.detail
    # The ledger's clock against the driver's: time the ledger never lived through is caught.
    assert check_wall_within(summary.clock_wall_s, measured_wall_s=31.0).ok
    assert not check_wall_within(summary.clock_wall_s, measured_wall_s=20.0).ok
    assert not check_wall_within(None, measured_wall_s=20.0).ok  # an older report proves nothing


# -- (f): processes -------------------------------------------------------------------------------


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_no_process_left():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    zombie = _sleeper()
    os.kill(zombie.pid, signal.SIGKILL)  # dead but not yet reaped: a zombie is not running
    running, stopped = _sleeper(), _sleeper()
    os.kill(stopped.pid, signal.SIGSTOP)  # a hung rank left behind is still a process left behind
    try:
        for _ in range(100):
            with open(f"/proc/{zombie.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert check_no_process_left([done.pid, zombie.pid]).ok
        check = check_no_process_left({"rank 0": done.pid, "rank 1": running.pid, "server": stopped.pid})
        assert not check.ok and check.detail.startswith("2 of 3 still running")
        assert f"rank 1 ({running.pid})" in check.detail and f"server ({stopped.pid})" in check.detail
    finally:
        for proc in (zombie, running, stopped):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert check_no_process_left([running.pid, stopped.pid]).ok


# -- check_all ------------------------------------------------------------------------------------


def test_check_all_runs_what_it_is_given_and_reports_each(catalog):
    report = check_all(catalog=catalog, final=_model(), reference=_model(), history=_run_with_a_failure(),
                       final_step=60, global_batch=8, goodput={"productive": 1.0}, wall_s=1.0)
    assert report.ok and [c.name for c in report.checks] == [
        "checkpoints_verify", "newest_loads", "model_matches_reference", "data_exactly_once", "goodput_sums_to_wall"]
    assert report.skipped == ["no_process_left"] and "SKIP  no_process_left" in report.table()
    corrupt_shard(catalog.storage, 30, seed=1)
    report = check_all(catalog=catalog, final=_model(), reference={"x": torch.zeros(1)}, pids=[],
                       goodput={"productive": 1.0})  # no wall_s for a dict
    assert not report.ok
    assert [c.name for c in report.failed] == ["checkpoints_verify", "newest_loads", "model_matches_reference",
                                               "goodput_sums_to_wall"]
    assert report.to_dict()["checks"][-1] == {"name": "no_process_left", "ok": True,
                                              "detail": "0 processes on this host all gone"}
    # Ranks on other hosts are not seen by this host's /proc: the line says so, never "all gone" alone.
    remote = check_all(pids=[], pids_elsewhere=3).checks[-1]
    assert remote.detail == "0 processes on this host all gone; 3 on other hosts not checked (this host's /proc only)"
    assert "FAIL  checkpoints_verify" in report.table()


def test_check_all_turns_a_crashing_check_into_a_failure(catalog):
    report = check_all(history=[("not", "a", "record", "at all")], final_step=1, global_batch=8)
    [check] = report.checks
    assert not check.ok and check.detail.startswith("check could not run: ValueError")


def test_a_corruption_no_restore_caught_is_expected_bad_and_one_caught_and_saved_again_is_not(catalog):
    from orchestrator.cli.chaos.experiment import _uncaught, final_model

    corrupt_shard(catalog.storage, 30, seed=0)  # the newest, never restored: still committed, corrupt
    corrupt_shard(catalog.storage, 20, seed=0)
    catalog.quarantine(20)  # a restore found it and moved it aside; the job then commits 20 again
    assert final_model(catalog, frozenset({30}))[0] == 10
    _save(catalog, 20)
    assert _uncaught(catalog, {20, 30}) == {30}
    assert final_model(catalog, frozenset({30}))[0] == 20  # the newest step not corrupted on purpose
    assert check_checkpoints_verify(catalog, expected_bad=_uncaught(catalog, {20, 30})).ok
    assert not check_checkpoints_verify(catalog, expected_bad={20, 30}).ok  # the clean save of 20 verifies


def test_a_run_whose_final_commit_was_corrupted_is_compared_with_the_reference_at_its_newest_intact_step(tmp_path):
    from orchestrator.cli.chaos.experiment import catalog_of, reference_model_at, reference_spec
    from orchestrator.spec.job_spec import validate_spec

    spec = validate_spec({"name": "c", "model": {"preset": "tiny"}, "train": {"steps": 30, "global_batch": 4},
                          "checkpoint": {"url": f"file://{tmp_path}/ck"}})
    reference = catalog_of(reference_spec(spec))
    for step in (20, 30):
        g = torch.Generator().manual_seed(step)
        receipts = [write_shard(reference.storage, step, 0, {"model/w": torch.randn(4, generator=g)}, blocking_s=0.0)]
        reference.commit(job=spec.name, step=step, generation=0, layout={"dp": 1}, spec_hash="h", receipts=receipts,
                         state={"engine": {"next_step": step}})
    at_20 = reference_model_at(spec, 20)
    assert list(at_20) == ["model/w"] and torch.equal(at_20["model/w"], torch.randn(4, generator=torch.Generator()
                                                                                   .manual_seed(20)))
    assert reference_model_at(spec, 10) is None  # retention dropped it: the model check is skipped, said so


def test_steps_a_killed_controller_trained_at_a_shrunken_dp_make_the_comparison_approximate():
    from types import SimpleNamespace

    from orchestrator.cli.chaos.experiment import dp_changed

    # The killed controller shrank to dp 1 and committed steps 10-19 there; its rerun trained at dp 2 only.
    carried = [["steps", 0, 10, 2], ["steps", 10, 20, 1], ["restore", 20], ["steps", 20, 30, 2]]
    rerun_only = SimpleNamespace(world_history=[SimpleNamespace(dp=2)], history=carried)
    assert dp_changed(rerun_only, 2)
    undone = [["steps", 0, 10, 2], ["steps", 10, 15, 1], ["restore", 10], ["steps", 10, 30, 2]]
    assert not dp_changed(SimpleNamespace(world_history=[SimpleNamespace(dp=2)], history=undone), 2)


def test_a_final_commit_corrupted_on_purpose_with_no_reference_at_the_newest_intact_step_fails_the_model_check(
        tmp_path):
    """The reference run keeps no checkpoint of the step the faulty run's newest intact one is: nothing is
    compared, and a check that compared nothing has not passed (it used to be skipped, the run PASS)."""
    from chaos.config import FaultSpec
    from monitor.report import FaultRecord, GoodputSummary, RunReport
    from orchestrator.cli.chaos.experiment import catalog_of, invariants, reference_spec
    from orchestrator.spec.job_spec import validate_spec
    from tests._checkpoints import flip_bit, make_state, save_checkpoint, shard_of

    spec = validate_spec({"name": "c", "model": {"preset": "tiny"}, "train": {"steps": 30, "global_batch": 4},
                          "checkpoint": {"url": f"file://{tmp_path}/ck", "every_steps": 10},
                          "chaos": {"faults": [FaultSpec(kind="corrupt_shard", at_step=30).model_dump()]}})
    faulty, reference = catalog_of(spec), catalog_of(reference_spec(spec))
    for step in (20, 30):
        save_checkpoint(faulty, step, make_state(step))
    save_checkpoint(reference, 30, make_state(30))  # its retention kept the final step only
    flip_bit(faulty, 30, shard_of(faulty, 30, next(iter(make_state(30)))))
    report = RunReport(job="c", final_step=30, status="succeeded", goodput=GoodputSummary.from_totals({}),
                       faults=[FaultRecord(kind="corrupt_shard", fault_id=0, step=30)])
    checks = invariants(spec, report, reference=make_state(30), pids=None)
    [model] = [c for c in checks.checks if c.name == "model_matches_reference"]
    assert not model.ok and "holds no checkpoint of step 20" in model.detail
    assert "model_matches_reference" not in checks.skipped and not checks.ok


def test_a_tolerance_after_a_dp_change_is_at_each_tensors_own_scale():
    # Adam's second moments are about 1e-8: a fixed atol of 1e-6 would pass any of them.
    reference = {"optim/w/exp_avg_sq": torch.full((4,), 2e-8, dtype=torch.float64)}
    off = {"optim/w/exp_avg_sq": torch.full((4,), 9e-8, dtype=torch.float64)}  # 4.5 times the value
    assert not check_model_matches(off, reference, exact=False, rtol=1e-5, atol=1e-6).ok
    near = {"optim/w/exp_avg_sq": reference["optim/w/exp_avg_sq"] * (1 + 1e-6)}
    assert check_model_matches(near, reference, exact=False, rtol=1e-5, atol=1e-6).ok
