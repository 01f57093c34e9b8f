"""Failure scenarios on a real local Ray cluster, each checked against the failure-free run.

Same layout afterwards -> the final loss is the reference's, bit for bit. After a shrink
and a grow -> within 1e-5 relative (only the reduction order changed).
"""

from __future__ import annotations

import json

import pytest

from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray


def _ok(proc, report_path) -> dict:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(report_path.read_text())


def test_hung_rank_is_detected_killed_and_replaced(ray_cluster, tmp_path, reference):
    proc, path = run_job(ray_cluster, tmp_path, "hang", ["chaos.faults=[{kind: hang_rank, rank: 2, at_step: 25}]"])
    report = _ok(proc, path)
    [failure] = report["failures"]
    assert failure["kind"] == "hang_rank" and failure["rank"] == 2
    # The watchdog fires after max(10 s, 5 x median step); the stopped process is then killed.
    assert 9.0 < failure["detected_after_s"] < 30.0
    assert "killed [2]" in proc.stdout
    assert report["final_loss"] == reference["final_loss"]


def test_warm_spare_takes_over_a_killed_rank(ray_cluster, tmp_path, reference):
    proc, path = run_job(ray_cluster, tmp_path, "spare",
                         ["elastic.spares=1", "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"])
    report = _ok(proc, path)
    assert "taken over by warm spares" in proc.stdout
    [failure] = report["failures"]
    assert failure["first_step_after_s"] is not None
    assert report["final_loss"] == reference["final_loss"]


# Shrink and grow back stay in the default suite through node loss
# (tests/ray/test_node_loss.py) and a rank kill that shrinks (tests/ray/test_chaos_cmd.py).
@pytest.mark.heavy
def test_shrink_without_replacement_then_grow_back(ray_cluster, tmp_path, reference):
    # replace_timeout_s=0: a new actor cannot be up in time, so dp shrinks 4 -> 2 (the largest
    # degree that divides 16 samples into microbatches of 2); the late replacement then warms
    # up as a spare and dp grows back to 4 at a later checkpoint. Rank 0 is slowed (sleeps
    # only: the numbers are unchanged) so that checkpoints remain after the spare is up.
    proc, path = run_job(ray_cluster, tmp_path, "shrink", [
        "elastic.replace_timeout_s=0",
        "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 12}, {kind: slow_rank, rank: 0, at_step: 0, factor: 6}]"])
    report = _ok(proc, path)
    assert "shrinking dp 4 -> 2" in proc.stdout and "growing dp 2 -> 4" in proc.stdout, proc.stdout[-3000:]
    assert [w["dp"] for w in report["world_history"]] == [4, 2, 4]
    assert len(report["failures"]) == 1
    assert report["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5)
    for ours, ref in zip(report["losses"], reference["losses"], strict=True):
        assert ours["step"] == ref["step"] and ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)


# Heavy (about 25 s on two cores): tests/s3/test_torn_writes.py kills writers at every point of a save
# and finds no checkpoint that does not verify; tests/ray/test_chaos_kinds.py tears a shard mid-run.
@pytest.mark.heavy
def test_kill_during_checkpoint_save_never_commits_a_partial_checkpoint(ray_cluster, tmp_path, reference):
    proc, path = run_job(ray_cluster, tmp_path, "torn", [
        "chaos.faults=[{kind: kill_rank, rank: 3, at_step: 20, at_point: during_shard_write}]"])
    report = _ok(proc, path)
    assert "restored step 10" in proc.stdout  # step 20 lacked rank 3's shard: never committed
    assert [c["step"] for c in report["checkpoints"]] == [10, 20, 30, 40]  # 20 saved again after the restore
    assert report["final_loss"] == reference["final_loss"]


# Heavy (about 20 s on two cores): tests/unit/test_controller.py's crash-loop test stops the job naming
# step, rank and error, and tests/unit/test_failure_policy.py decides what a crash loop is.
@pytest.mark.heavy
def test_crash_loop_fails_with_step_rank_and_exception(ray_cluster, tmp_path):
    proc, path = run_job(ray_cluster, tmp_path, "loop", [
        "chaos.faults=[{kind: raise, rank: 2, at_step: 25, repeat: true, message: bad batch}]"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["status"] == "failed"
    assert "crash loop: rank 2 failed at step 25 3 times" in report["error"]
    assert "InjectedFault: bad batch" in report["error"]
    assert report["final_step"] == 20  # the last committed checkpoint is intact
