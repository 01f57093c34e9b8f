"""SIGTERM to `undying run` of a parameter-server job: it cuts the segment where every worker can stop,
saves the cut and stops there, exits 75 and releases its owner lease, and a rerun resumes from it.
During the set-up (the wait for another driver's lease) it stops at once, exit 75 as well."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from ckpt.catalog import Catalog
from ckpt.owner_claims import newest_claim
from ckpt.storage import Storage
from tests.ray.jobs import ROOT, UNDYING, claim_from_elsewhere

pytestmark = pytest.mark.ray


def _cmd(tmp_path, report, steps: int) -> list[str]:
    cmd = [UNDYING, "run", str(ROOT / "examples/ps.yaml"), "--report", str(report)]
    for item in [f"train.steps={steps}", "checkpoint.every_steps=10", f"checkpoint.url=file://{tmp_path}/ckpt"]:
        cmd += ["--set", item]
    return cmd


# Heavy (two runs, about 50 s on two cores): tests/unit/test_ps_supervisor.py cuts the segment at a signal
# and stops at that commit, tests/unit/test_ps_checkpoint.py saves and restores servers, and the set-up
# test below runs the parameter-server driver end to end to its exit 75.
@pytest.mark.heavy
def test_sigterm_stops_a_ps_job_with_exit_75_and_the_rerun_resumes(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/ps-tiny"))
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, tmp_path / "first.json", 400), stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
    deadline = time.monotonic() + 240
    while not (catalog.storage.exists(catalog.storage.root) and catalog.committed_steps()):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = proc.wait(timeout=60)
    text = log.read_text()
    assert code == 75, text[-3000:]
    assert time.monotonic() - sent < 25.0  # elastic.preemption_grace_s's default
    assert "job preempted: SIGTERM" in text and "rerun the job to resume" in text
    committed = catalog.committed_steps()[-1]
    assert committed >= 10  # the first commit, or the signal's cut a step or so later
    assert f"stopped at checkpoint step {committed}, just committed" in text, text[-3000:]
    # Not the segment's end: the signal cuts segment [10, 20) a step or so after it came, or, when it
    # landed while step 10's commit was finishing (the test signals once that manifest appears), the
    # job stops at that commit before the next segment starts.
    cut = f"a signal: the segment [10, 20) is cut at step {committed}" in text
    assert committed < 20 and (cut or committed == 10), text[-3000:]
    # The lease was released: the rerun claims at once and resumes from the last commit.
    again = subprocess.run(_cmd(tmp_path, tmp_path / "again.json", committed + 10), capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    report = json.loads((tmp_path / "again.json").read_text())
    assert report["first_step"] == committed and "watching" not in again.stdout
    # The checkpoint carries the ledger, and the rerun's goodput spans both runs.
    saved = catalog.read_manifest(committed).state["goodput"]
    assert saved["productive"] > 0
    assert report["goodput"]["clock_wall_s"] > sum(saved.values())
    assert report["goodput"]["productive_s"] >= saved["productive"]


def test_sigterm_during_the_set_up_of_a_ps_job_exits_75_at_once(tmp_path):
    storage = Storage(f"file://{tmp_path}/ckpt/ps-tiny")
    claim_from_elsewhere(storage, 0, "ps-tiny", lease_s=120.0)  # a driver elsewhere, watched for minutes
    log = tmp_path / "setup.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_cmd(tmp_path, tmp_path / "setup.json", 40), stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while "watching its heartbeat" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, log.read_text()[-3000:]
    text = log.read_text()
    assert "job preempted: SIGTERM while the job was set up" in text and "Traceback" not in text, text[-3000:]
    assert newest_claim(storage).host == "node-9" and not (tmp_path / "setup.json").exists()
