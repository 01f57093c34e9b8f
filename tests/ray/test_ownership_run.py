"""One driver per job, end to end (ckpt.ownership): a second `undying run` of a running job exits 2
naming the first; a driver whose checkpoint folder another claimed fails without committing
again; a rerun after a driver elsewhere went silent takes over after watching for one lease and
finishes the job."""

from __future__ import annotations

import json
import time

import pytest

from ckpt.catalog import Catalog
from ckpt.owner_claims import OWNER_DIR, epochs, newest_claim
from ckpt.storage import Storage
from tests.ray.jobs import run_job, start_job, wait_for

pytestmark = pytest.mark.ray
LEASE = ["checkpoint.owner_lease_s=3"]  # a beat every 0.5 s
SLOW = ["chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 4}]"]  # training lasts ~10 s


def _claim_from_elsewhere(storage: Storage, epoch: int) -> float:
    """What a driver on another host writes when it judged the owner dead: a claim and one beat."""
    now = time.time()
    record = {"holder": "undying run of job 'own'", "lease_s": 3.0, "claimed_at": now,
              "process": {"host": "node-9/boot/pid:[1]", "pid": 777, "started": "1"}, "taken_because": "test"}
    storage.create_exclusive(storage.path(OWNER_DIR, f"claim-{epoch:010d}.json"), json.dumps(record).encode())
    storage.write_immutable(storage.path(OWNER_DIR, f"beat-{epoch:010d}.json"),
                            json.dumps({"beat": 1, "time": now, "ended": False}).encode())
    return now


def test_one_driver_owns_a_job_and_a_replaced_one_stops_committing(ray_cluster, tmp_path):
    first, _, log = start_job(ray_cluster, tmp_path, "own", [*LEASE, *SLOW])
    wait_for(log, "-> RUNNING", first)
    second, _ = run_job(ray_cluster, tmp_path, "own", LEASE, timeout=120)
    assert second.returncode == 2, second.stdout[-3000:] + second.stderr[-3000:]
    assert "held by undying run of job 'own' on host" in second.stderr
    assert f"pid {first.pid}" in second.stderr and first.poll() is None  # the first runs on, untouched

    storage = Storage(f"file://{tmp_path}/ckpt/own")
    wait_for(log, " committed: ", first)  # a commit's line ("fresh start (no committed checkpoint)" comes first)
    claimed_at = _claim_from_elsewhere(storage, epochs(storage)[-1] + 1)
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
