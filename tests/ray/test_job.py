"""End to end on a real local Ray cluster: the CLI places 4 ranks, a rank is killed, the job
recovers from its last committed checkpoint and ends with exactly the failure-free result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from orchestrator.cli.chaos.invariants import check_model_matches
from tests.ray.jobs import BASE, ROOT, UNDYING, goodput_checks
from tests.ray.jobs import run_job as _run

pytestmark = pytest.mark.ray


def test_failure_free_run_reports_everything(reference):
    assert reference["status"] == "succeeded" and reference["final_step"] == 40
    assert [p["step"] for p in reference["losses"]] == list(range(40))
    assert reference["losses"][-1]["loss"] < reference["losses"][0]["loss"]
    assert [c["step"] for c in reference["checkpoints"]] == [10, 20, 30, 40]
    assert reference["failures"] == []
    checks = goodput_checks(reference, reference["measured_wall_s"])
    assert all(check.ok for check in checks), [check.detail for check in checks]
    assert reference["world_history"][0]["world_size"] == 4


def test_killed_rank_recovers_bit_exact(ray_cluster, tmp_path, reference):
    proc, report_path = _run(ray_cluster, tmp_path, "kill",
                             ["chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert "RUNNING -> RECOVERING" in proc.stdout and "restored step 20" in proc.stdout
    [failure] = report["failures"]
    assert failure["kind"] == "kill_rank" and failure["rank"] == 1
    assert failure["detected_after_s"] < 1.0 and failure["recovered_after_s"] is not None
    assert len(report["world_history"]) == 2
    # The ledger adds up across the kill and books what it cost (the lost work's size against the
    # thrown-away executions: tests/ray/test_monitoring.py, heavy).
    checks = goodput_checks(report, proc.wall_s)
    assert all(check.ok for check in checks), [check.detail for check in checks]
    goodput = report["goodput"]
    assert all(goodput["badput_s"][bucket] > 0 for bucket in ("detection", "checkpoint_restore", "lost_work"))
    # Steps 20..25 ran twice; rank 0 may finish step 25 before its next collective fails.
    assert report["redone_steps"] == 6
    assert sorted(r["step"] for r in report["rolled_back"]) in (list(range(20, 25)), list(range(20, 26)))
    # Same layout, deterministic run: the recovered model is the failure-free model, its final
    # checkpoint (the last update and the optimizer state too) equal bit for bit.
    assert report["final_loss"] == reference["final_loss"]
    losses = [(p["step"], p["loss"]) for p in report["losses"]]
    assert losses == [(p["step"], p["loss"]) for p in reference["losses"]]
    assert_same_final_checkpoint(tmp_path / "ckpt" / "kill", reference)


def assert_same_final_checkpoint(root, reference) -> None:
    final = [load_checkpoint(Catalog(Storage(f"file://{where}")), 40)[0]
             for where in (root, reference["checkpoint_dir"])]
    check = check_model_matches(*final, exact=True)
    assert check.ok and any(name.startswith("optim/") for name in final[0]), check.detail


def test_a_killed_rank_restored_from_memory_ends_with_the_failure_free_model(ray_cluster, tmp_path, reference):
    # The memory level is on by default: its restore must be as exact as storage's (the buddies'
    # copies, on one node here; across nodes and with nodes lost: tests/ray/test_memory_level.py, heavy).
    proc, report_path = _run(ray_cluster, tmp_path, "memkill", [
        "checkpoint.memory={enabled: true, every_steps: 3}", "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    [failure] = report["failures"]
    assert failure["restore_level"] == "memory" and failure["storage_read_bytes"] == 0, failure
    assert "restored step 24 from memory" in proc.stdout and report["redone_steps"] < 6
    assert [(p["step"], p["loss"]) for p in report["losses"]] == [(p["step"], p["loss"]) for p in reference["losses"]]
    assert_same_final_checkpoint(tmp_path / "ckpt" / "memkill", reference)


# Heavy (two runs, about 70 s on two cores): tests/ray/test_chaos_cmd.py's kill_controller test keeps a killed
# controller's rerun in the default suite (it resumes, and its goodput sums to the wall across the kill).
@pytest.mark.heavy
def test_rerun_of_a_killed_controller_resumes(ray_cluster, tmp_path, reference):
    """SIGKILL the whole `undying run` after a checkpoint commits; running it again resumes."""
    ckpt = tmp_path / "ckpt" / "resume"
    sets = [*BASE, "name=resume", f"checkpoint.url=file://{tmp_path}/ckpt", "chaos.faults=[]"]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    first_started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not (ckpt / "step-000000020" / "manifest.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint committed"
        time.sleep(0.05)
    killed_at = time.time()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2.0)  # no controller runs: the successor books this (and its own start-up) as `other`
    restarted_at = time.time()
    again, report_path = _run(ray_cluster, tmp_path, "resume", ["chaos.faults=[]"])
    ended_at = time.time()
    assert again.returncode == 0, again.stdout + again.stderr
    report = json.loads(report_path.read_text())
    resumed_from = min(p["step"] for p in report["losses"])
    assert resumed_from >= 20 and f"restored step {resumed_from}" in again.stdout
    assert report["final_loss"] == reference["final_loss"]
    # Goodput across the kill (orchestrator.controller.ledger_snapshot): the dead controller's last snapshot
    # (at most 5 s before the kill) to the successor's start is `other`, and the wall covers the
    # whole job, both runs and the gap, less the first run's start-up before its ledger began.
    goodput = report["goodput"]
    assert restarted_at - killed_at <= goodput["badput_s"]["other"] <= restarted_at - killed_at + 5.0 + 30.0
    assert goodput_checks(report, ended_at - first_started)[0].ok  # the buckets add up to the ledger's clock
    assert ended_at - first_started - 30.0 <= goodput["clock_wall_s"] <= ended_at - first_started
    finished, _ = _run(ray_cluster, tmp_path, "resume", ["chaos.faults=[]"])
    assert finished.returncode == 0 and "already finished" in finished.stdout
