"""One driver per job, end to end (ckpt.ownership): a second `undying run` of a running job exits 2
naming the first; a driver whose checkpoint folder another claimed fails without committing
again; a rerun after a driver elsewhere went silent takes over after watching for one lease and
finishes the job; SIGTERM while a driver watches such a heartbeat (its set-up, before it trains)
ends it at once, exit 75, with no claim of its own left behind."""

from __future__ import annotations

import json
import signal
import time

import pytest

from ckpt.catalog import Catalog
from ckpt.owner_claims import epochs, newest_claim
from ckpt.storage import Storage
from tests.ray.jobs import claim_from_elsewhere, run_job, start_job, wait_for

pytestmark = pytest.mark.ray
LEASE = ["checkpoint.owner_lease_s=3"]  # a beat every 0.5 s
SLOW = ["chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 4}]"]  # training lasts ~10 s


# Heavy (three drivers, about 60 s on two cores): tests/s3/test_ownership.py keeps the lease's rules on a
# real S3 server and a folder (a beating holder refused, a replaced or released one changing nothing, a
# silent one taken after a lease), and the SIGTERM test below a driver waiting for another's root.
@pytest.mark.heavy
def test_one_driver_owns_a_job_and_a_replaced_one_stops_committing(ray_cluster, tmp_path):
    first, _, log = start_job(ray_cluster, tmp_path, "own", [*LEASE, *SLOW])
    wait_for(log, "-> RUNNING", first)
    second, _ = run_job(ray_cluster, tmp_path, "own", LEASE, timeout=120)
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    assert "held by undying run of job 'own' on host" in second.stderr
    assert f"pid {first.pid}" in second.stderr and first.poll() is None  # the first runs on, untouched

    storage = Storage(f"file://{tmp_path}/ckpt/own")
    wait_for(log, " committed: ", first)  # a commit's line ("fresh start (no committed checkpoint)" comes first)
    claimed_at = claim_from_elsewhere(storage, epochs(storage)[-1] + 1, "own")
    assert first.wait(timeout=60) == 1
    text = log.read_text()
    assert "no longer owns it" in text and "node-9, pid 777" in text, text[-3000:]
    catalog = Catalog(storage)
    committed = catalog.committed_steps()
    assert committed and all(catalog.read_manifest(s).created_at < claimed_at for s in committed)

    rerun, report = run_job(ray_cluster, tmp_path, "own", LEASE, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "held by undying run of job 'own' on host node-9, pid 777; watching its heartbeat" in rerun.stdout
    rerun_claim = newest_claim(storage)  # the rerun took the silent claim over, and released it at its end
    assert rerun_claim.host != "node-9" and rerun_claim.beat["ended"]
    assert "on host node-9, pid 777) sent no heartbeat for 3 s" in rerun_claim.record["taken_because"]
    result = json.loads(report.read_text())
    assert result["status"] == "succeeded" and result["final_step"] == 40
    assert min(p["step"] for p in result["losses"]) == committed[-1]  # resumed at the first driver's last commit


def test_sigterm_while_the_driver_waits_for_the_root_exits_preempted_at_once(ray_cluster, tmp_path):
    # A pod evicted during its set-up: exit 75 (retry it), as a signal during training gives, not
    # Ray's SystemExit(15); the other host's claim stays the newest (this driver never claimed).
    storage = Storage(f"file://{tmp_path}/ckpt/own")
    claim_from_elsewhere(storage, 0, "own", lease_s=120.0)  # watched for two minutes before it could be taken
    proc, _, log = start_job(ray_cluster, tmp_path, "own", LEASE)
    wait_for(log, "watching its heartbeat", proc)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75, log.read_text()[-3000:]
    assert time.monotonic() - signalled < 30  # the watch was cut short, not waited out
    text = log.read_text()
    assert "undying: job preempted: SIGTERM while the job was set up, before it trained" in text, text[-3000:]
    assert "Traceback" not in text
    assert epochs(storage) == [0] and newest_claim(storage).host == "node-9"


# Heavy (two drivers, about 60 s on two cores): the lease's takeover rules are the test above's and
# tests/s3/test_ownership.py's; this one is about the seats a stopped driver still reserves.
@pytest.mark.heavy
def test_a_rerun_takes_over_from_a_stopped_driver_on_the_same_cluster_and_frees_its_seats(ray_cluster, tmp_path):
    """The first driver stops (SIGSTOP) with its 4 ranks placed; the cluster has 6 seats, so the rerun's
    4 fit only once the first's placement group is gone: the rerun takes the silent lease over, removes
    the group named for the root, and finishes the job."""
    first, _, log = start_job(ray_cluster, tmp_path, "stopped", [*LEASE, *SLOW])
    try:
        wait_for(log, " committed: ", first)
        first.send_signal(signal.SIGSTOP)
        rerun, report = run_job(ray_cluster, tmp_path, "stopped", LEASE, timeout=300)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert "removed 1 placement group(s) a former driver" in rerun.stderr, rerun.stderr[-3000:]
        assert json.loads(report.read_text())["status"] == "succeeded"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
