"""Tracking end to end on a real local Ray cluster: the TensorBoard event files of a run hold one loss
scalar per step (read back with tensorboard's own reader), and `undying report CKPT_URL` rebuilds the
run's report and timeline PNG from the event log under the checkpoint root alone, after the
directory the run wrote its report, timeline and TensorBoard files to is deleted."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.ray.jobs import BASE, ROOT, UNDYING

pytestmark = pytest.mark.ray


def _scalars(logdir: str, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})  # 0: keep every point, no sampling
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _report(url: str, png: str) -> dict:
    """`undying report URL --json` as a user runs it; its output must parse."""
    proc = subprocess.run([UNDYING, "report", url, "--json", "--timeline", png], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_the_reference_run_has_one_loss_point_per_step_and_its_report_rebuilds(reference, tmp_path):
    losses = _scalars(reference["tensorboard_dir"], "train/loss")
    assert [step for step, _ in losses] == list(range(40))
    assert [value for _, value in losses] == pytest.approx([p["loss"] for p in reference["losses"]], rel=1e-6)
    assert len(_scalars(reference["tensorboard_dir"], "checkpoint/total_s")) == 4
    result = _report(f"file://{reference['checkpoint_dir']}", str(tmp_path / "t.png"))
    expected = {k: v for k, v in reference.items() if k not in ("checkpoint_dir", "tensorboard_dir", "measured_wall_s")}
    assert result["report"] == expected
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.heavy
def test_a_recovered_run_is_rebuilt_from_its_event_log_after_its_run_directory_is_deleted(ray_cluster, tmp_path):
    run_dir, ckpt = tmp_path / "run", f"file://{tmp_path}/ckpt"
    sets = [*BASE, "name=tracked", f"checkpoint.url={ckpt}", f"monitor.tensorboard={run_dir}/tb",
            "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(run_dir / "report.json"),
           "--timeline", str(run_dir / "timeline.png"), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert len(report["failures"]) == 1 and report["redone_steps"] > 0

    losses = _scalars(str(run_dir / "tb"), "train/loss")
    # every finished execution of a step is one point: the steps the rollback threw away twice
    assert sorted({step for step, _ in losses}) == list(range(40)) and len(losses) == 40 + len(report["rolled_back"])
    last = dict(losses)  # the newest point of each step: the execution the model kept
    assert [last[p["step"]] for p in report["losses"]] == pytest.approx([p["loss"] for p in report["losses"]])
    assert [value for _, value in _scalars(str(run_dir / "tb"), "recovery/failures")] == [1.0]
    assert len(_scalars(str(run_dir / "tb"), "recovery/recovered_after_s")) == 1

    shutil.rmtree(run_dir)  # the pod that ran it is gone: only the checkpoint root is left
    result = _report(f"{ckpt}/tracked", str(tmp_path / "rebuilt.png"))
    assert result["report"] == report
    assert (tmp_path / "rebuilt.png").read_bytes()[:4] == b"\x89PNG"
