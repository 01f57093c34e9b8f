"""`ray job submit` against the local head: the documented way to run on a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray.jobs import ROOT

pytestmark = pytest.mark.ray


def test_ray_job_submit_runs_the_job(ray_head, tmp_path):
    report = tmp_path / "report.json"
    cmd = [
        str(Path(sys.executable).parent / "ray"), "job", "submit",
        "--address", os.environ["UNDYING_TEST_DASHBOARD"], "--working-dir", str(ROOT), "--",
        "undying", "run", "examples/tiny.yaml",
        "--set", "train.steps=20", "--set", "checkpoint.every_steps=10",
        "--set", f"checkpoint.url=file://{tmp_path}/ckpt",
        "--set", "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 15}]",
        "--report", str(report),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "succeeded" in proc.stdout and "RECOVERING" in proc.stdout
    result = json.loads(report.read_text())
    assert result["status"] == "succeeded" and result["final_step"] == 20
    assert [f["kind"] for f in result["failures"]] == ["kill_rank"]
