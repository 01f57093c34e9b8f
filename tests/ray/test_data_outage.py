"""An outage of the data store costs the job a wait, not a rollback, end to end on the local Ray
cluster: with the training data on a real S3 server (SeaweedFS), and under `undying chaos` with a
data fault on local data.

The server is frozen (SIGSTOP: its connections stay open and nothing answers) for 12 s, three
times the 4 s hang limit, while the job trains from it. The ranks' reads time out (1 s client
timeouts), are retried by the client and then by the rank (`data.read_retry_s`), and the ranks
beat while they wait for their data (`data_wait_s`), so the controller's watchdog declares no
hang; the job ends with no failure and the wait booked as the data bucket of its ledger. Under
`undying chaos`, every rank's data reads are refused with S3's 503 SlowDown for 12 s (a storage
fault with `target: data`): the run ends bit-identical to its failure-free reference, every
invariant passing.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import numpy as np
import pytest

from tests._tokens import write_token_dataset
from tests.ray.jobs import assert_every_check_passed, chaos_job, start_job, wait_for
from tests.s3._seaweed import BUCKET
from tests.s3.conftest import s3_server as s3_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.ray

HANG_S = 4
OUTAGE_S = 12


# Heavy (about 60 s on two cores): tests/unit/test_data_read_retry.py keeps each part of it in the default
# suite against a failing fsspec store: reads retried per outage, the rank beating while it waits, the
# watchdog counting it busy, the collective timeout outlasting the outage.
@pytest.mark.heavy
@pytest.mark.s3
def test_a_data_store_frozen_for_three_hang_limits_is_waited_out_without_a_failure(ray_cluster, s3_server,
                                                                                   tmp_path):
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/tokens"
    tokens = np.random.default_rng(0).integers(0, 256, size=40_000)
    write_token_dataset(url, tokens, vocab_size=256, shard_tokens=7_000, storage_options=s3_server.storage_options)
    options = tmp_path / "s3-options.json"
    options.write_text(json.dumps({**s3_server.storage_options, "config_kwargs": {
        "connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}))
    os.chmod(options, 0o600)
    proc, report, log = start_job(ray_cluster, tmp_path, "dataoutage", [
        "data.source=tokens", f"data.path={url}", f"data.storage_options_file={options}", "data.seq_len=32",
        "data.read_retry_s=60", f"elastic.hang_timeout_s={HANG_S}", "train.steps=200", "chaos.faults=[]"])
    pid = s3_server.proc.pid
    try:
        wait_for(log, "-> RUNNING", proc)
        time.sleep(1.0)  # some steps in: the outage meets training, not its first step
        os.kill(pid, signal.SIGSTOP)
        time.sleep(OUTAGE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    code = proc.wait(timeout=300)
    text = log.read_text()
    assert code == 0, text[-5000:]
    result = json.loads(report.read_text())
    assert result["failures"] == [] and "no step for" not in text, text[-5000:]
    assert result["final_step"] == 200
    assert result["goodput"]["badput_s"]["data"] >= OUTAGE_S - HANG_S, result["goodput"]


# Heavy (two runs, about 90 s on two cores): tests/unit/test_chaos_data_faults.py keeps the data fault's
# window in the default suite, and tests/unit/test_data_read_retry.py the wait.
@pytest.mark.heavy
@pytest.mark.timeout(600)  # two runs of the job: the reference and the throttled one
def test_a_chaos_run_whose_data_store_throttles_every_read_for_12_s_matches_its_reference(ray_cluster, tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=40_000)
    write_token_dataset(tmp_path / "train", tokens, vocab_size=256, shard_tokens=7_000)
    outage = f"{{kind: storage_throttle, target: data, at_step: 60, duration_s: {OUTAGE_S}}}"  # mid-training
    proc, report_path = chaos_job(ray_cluster, tmp_path, "datathrottle", [], [
        "data.source=tokens", f"data.path=file://{tmp_path}/train", "data.seq_len=32", "train.steps=200",
        "checkpoint.every_steps=20", f"elastic.hang_timeout_s={HANG_S}", f"chaos.faults=[{outage}]"], timeout=540)
    report = assert_every_check_passed(proc, report_path)
    assert report["failures"] == [] and "no step for" not in proc.stdout, proc.stdout[-4000:]
    assert "chaos: storage_throttle (before) on rank" in proc.stdout  # it fired, on the ranks' data reads
    assert report["goodput"]["badput_s"]["data"] >= OUTAGE_S - HANG_S, report["goodput"]

