"""End to end on a real local Ray cluster: the CLI places 4 ranks, a rank is killed, the job
recovers from its last committed checkpoint and ends with exactly the failure-free result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
UNDYING = str(Path(sys.executable).parent / "undying")

BASE = [
    "train.steps=40", "checkpoint.every_steps=10", "checkpoint.keep=2", "parallel.dp=4",
    "train.global_batch=16", "train.micro_batch=2",
]


def _run(ray_cluster: str, tmp: Path, name: str, extra: list[str], timeout: float = 240):
    report = tmp / f"{name}.json"
    sets = [*BASE, f"name={name}", f"checkpoint.url=file://{tmp}/ckpt", *extra]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(report), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, report


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """The failure-free run every faulty run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    proc, report = _run(ray_cluster, tmp, "ref", ["chaos.faults=[]"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(report.read_text())


def test_failure_free_run_reports_everything(reference):
    assert reference["status"] == "succeeded" and reference["final_step"] == 40
    assert [p["step"] for p in reference["losses"]] == list(range(40))
    assert reference["losses"][-1]["loss"] < reference["losses"][0]["loss"]
    assert [c["step"] for c in reference["checkpoints"]] == [10, 20, 30, 40]
    assert reference["failures"] == []
    goodput = reference["goodput"]
    assert abs(goodput["productive_s"] + sum(goodput["badput_s"].values()) - goodput["wall_s"]) < 1e-6
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
    assert report["goodput"]["badput_s"]["lost_work"] > 0
    # Same layout, deterministic run: the recovered model is the failure-free model.
    assert report["final_loss"] == reference["final_loss"]
    assert report["losses"] == reference["losses"]


def test_rerun_of_a_killed_controller_resumes(ray_cluster, tmp_path, reference):
    """SIGKILL the whole `undying run` after a checkpoint commits; running it again resumes."""
    ckpt = tmp_path / "ckpt" / "resume"
    sets = [*BASE, "name=resume", f"checkpoint.url=file://{tmp_path}/ckpt", "chaos.faults=[]"]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not (ckpt / "step-000000020" / "manifest.json").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint committed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again, report_path = _run(ray_cluster, tmp_path, "resume", ["chaos.faults=[]"])
    assert again.returncode == 0, again.stdout + again.stderr
    report = json.loads(report_path.read_text())
    resumed_from = min(p["step"] for p in report["losses"])
    assert resumed_from >= 20 and f"restored step {resumed_from}" in again.stdout
    assert report["final_loss"] == reference["final_loss"]
    finished, _ = _run(ray_cluster, tmp_path, "resume", ["chaos.faults=[]"])
    assert finished.returncode == 0 and "already finished" in finished.stdout
