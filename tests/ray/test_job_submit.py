"""`ray job submit` against the local head: the documented way to run on a cluster."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
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


def test_stop_jobs_gives_a_running_job_s_driver_sigterm_and_waits_for_it(ray_head, tmp_path):
    """A head pod's preStop hook (deploy/kuberay): each job's driver gets SIGTERM itself and the
    command returns once the job has ended. The driver's exit 75 fails the job (a RayJob's
    backoffLimit retries it), where Ray's own stop would have ended it STOPPED (a completed RayJob)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from orchestrator.cli.main import main

    marker = tmp_path / "got-sigterm"
    driver = (f"import ray, signal, sys, time; ray.init(); signal.signal(signal.SIGTERM, lambda *_: "
              f"(open({str(marker)!r}, 'w').write('x'), sys.exit(75))); print('up', flush=True); time.sleep(600)")
    client = JobSubmissionClient(os.environ["UNDYING_TEST_DASHBOARD"])
    job = client.submit_job(entrypoint=f"{sys.executable} -c \"{driver}\"")
    deadline = time.monotonic() + 120
    while "up" not in client.get_job_logs(job) or client.get_job_info(job).driver_info is None:
        assert time.monotonic() < deadline and client.get_job_status(job) in (JobStatus.PENDING, JobStatus.RUNNING)
        time.sleep(0.5)
    assert main(["stop-jobs", "--address", os.environ["UNDYING_TEST_DASHBOARD"], "--wait", "60"]) == 0
    assert marker.exists() and client.get_job_status(job) == JobStatus.FAILED
    assert client.get_job_info(job).driver_exit_code == 75
    assert main(["stop-jobs", "--address", os.environ["UNDYING_TEST_DASHBOARD"], "--wait", "1"]) == 0  # none left
    assert socket.getdefaulttimeout() is None  # its request timeout is not left on this process's sockets
