"""The README's `undying run job.yaml --set checkpoint.url=s3://bucket/ckpt`, in the default suite:
the 4-rank job checkpoints to a real S3 server (SeaweedFS) through the process writer (the one an
object store gets), a rank killed at step 25 is restored from S3 (the memory level off: tests/ray/
jobs.py BASE), and the run ends with the failure-free model and optimizer state bit for bit."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from orchestrator.cli.chaos.invariants import check_model_matches
from tests.ray.jobs import run_job
from tests.s3._seaweed import BUCKET
from tests.s3.conftest import s3_server as s3_server  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.ray, pytest.mark.s3]


def test_a_job_on_s3_restores_a_killed_rank_from_its_checkpoints_there(ray_cluster, s3_server, tmp_path, reference):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    options = tmp_path / "s3-options.json"
    options.write_text(json.dumps(s3_server.storage_options))
    os.chmod(options, 0o600)  # credentials: a file only its owner reads
    proc, report_path = run_job(ray_cluster, tmp_path, "s3kill", [
        f"checkpoint.url={url}", f"checkpoint.storage_options_file={options}",
        "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    [failure] = report["failures"]
    assert failure["restore_level"] == "storage" and failure["storage_read_bytes"] > 0, failure
    assert "restored step 20" in proc.stdout
    assert [(p["step"], p["loss"]) for p in report["losses"]] == [(p["step"], p["loss"]) for p in reference["losses"]]
    on_s3 = Catalog(Storage(f"{url}/s3kill", s3_server.storage_options))
    assert on_s3.committed_steps()[-1] == 40
    final, expected = (load_checkpoint(catalog, 40)[0]
                       for catalog in (on_s3, Catalog(Storage(f"file://{reference['checkpoint_dir']}"))))
    check = check_model_matches(final, expected, exact=True)
    assert check.ok, check.detail
