"""Restore under a failing store, end to end on the real Ray test cluster, on file:// and on a real
S3 server (SeaweedFS): every rank's restore reads failing for 10 s (I/O errors on two ranks, S3's 503
SlowDown on the other two) are waited out, the newest checkpoint is restored and the final model
equals the failure-free run's bit for bit (`undying chaos` runs that reference and compares); a
corrupt newest shard on S3 sends the job one checkpoint back, loudly (the file:// case is
tests/ray/test_chaos_kinds.py); a store that keeps failing past `checkpoint.read_retry_s`, and
checkpoints that are all corrupt, make the job exit 1 naming them, with nothing deleted.

Each test runs two or three 40-step jobs (heavy; about a minute each on two cores):

    .venv/bin/python -m pytest -m heavy tests/ray/test_restore_faults.py
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from chaos.corrupt import corrupt_shard
from ckpt.catalog import Catalog
from ckpt.storage import Storage
from tests.ray.jobs import BASE, ROOT, UNDYING
from tests.s3._seaweed import BUCKET
from tests.s3.conftest import s3_server as s3_server  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.ray, pytest.mark.heavy]

# Ranks 0 and 1 get I/O errors, ranks 2 and 3 throttling, on every restore read for 10 s from the
# first one; rank 2 is killed at step 25, so the generation after it restores the step-20 checkpoint.
OUTAGE = ("chaos.faults=[{kind: kill_rank, rank: 2, at_step: 25}"
          + "".join(f", {{kind: {kind}, rank: {rank}, op: read, duration_s: 10}}"
                    for rank, kind in enumerate(["storage_error"] * 2 + ["storage_throttle"] * 2)) + "]")


def _root(kind: str, request, tmp_path) -> tuple[str, list[str], dict]:
    """A fresh checkpoint URL of `kind`, the --set items that reach it, and its storage options."""
    if kind == "file":
        return f"file://{tmp_path}/ckpt", [], {}
    server = request.getfixturevalue("s3_server")
    options = tmp_path / "s3-options.json"
    options.write_text(json.dumps(server.storage_options))
    os.chmod(options, 0o600)
    return f"s3://{BUCKET}/{uuid.uuid4().hex}", [f"checkpoint.storage_options_file={options}"], \
        server.storage_options


def _undying(command: str, ray_cluster: str, name: str, url: str, sets: list[str], report=None, flags=(),
             timeout: float = 600) -> tuple[subprocess.CompletedProcess, str]:
    cmd = [UNDYING, command, str(ROOT / "examples/demo.yaml"), "--address", ray_cluster, *flags]
    if report is not None:
        cmd += ["--report", str(report)]
        if command == "chaos":  # beside the report: the timeline's default is the working directory, the checkout
            cmd += ["--timeline", str(report.with_suffix(".png"))]
    for item in [*BASE, f"name={name}", f"checkpoint.url={url}", "chaos.faults=[]", *sets]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, proc.stdout + proc.stderr


def _objects(url: str, options: dict) -> list[str]:
    """Every object under `url` but each run's own bookkeeping: its event log and its owner lease."""
    storage = Storage(url, options)
    return sorted(p for p in storage.fs.find(storage.root) if "/events/" not in p and "/owner/" not in p)


kinds = pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])


@kinds
def test_every_ranks_restore_reads_failing_for_10_s_restore_the_newest_checkpoint_bit_for_bit(
        kind, ray_cluster, tmp_path, request):
    url, sets, _ = _root(kind, request, tmp_path)
    report_path = tmp_path / "chaos.json"
    proc, out = _undying("chaos", ray_cluster, f"outage-{kind}", url, [*sets, OUTAGE], report=report_path)
    assert proc.returncode == 0, out[-6000:]
    assert "PASS  model_matches_reference" in out and "every check passed" in out, out[-4000:]
    run_lines = out[out.index("RENDEZVOUS -> RESTORING: generation 1"):]  # the faulty run's recovery
    assert "restored step 20 in" in run_lines and "is corrupt" not in out and "falling back" not in out
    seconds = float(run_lines.split("restored step 20 in ", 1)[1].split(" s", 1)[0])
    assert seconds >= 10.0, seconds  # the ranks waited the outage out, then read the newest checkpoint
    report = json.loads(report_path.read_text())
    assert [f["kind"] for f in report["failures"]] == ["kill_rank"]


@pytest.mark.s3
def test_a_corrupt_newest_shard_on_s3_sends_the_job_one_checkpoint_back_loudly(ray_cluster, tmp_path, request):
    url, sets, _ = _root("s3", request, tmp_path)
    report_path = tmp_path / "chaos.json"
    proc, out = _undying("chaos", ray_cluster, "corrupt-s3", url, [
        *sets, "chaos.faults=[{kind: corrupt_shard, at_step: 20}, {kind: kill_rank, rank: 1, at_step: 25}]"],
        report=report_path)
    assert proc.returncode == 0, out[-6000:]
    assert "checkpoint step 20 is corrupt" in out and "checksum mismatch" in out and "moved aside" in out
    assert "restored step 10" in out and "PASS  model_matches_reference" in out, out[-4000:]


@kinds
def test_unreadable_checkpoints_fail_the_job_naming_them_and_delete_nothing(kind, ray_cluster, tmp_path, request):
    url, sets, options = _root(kind, request, tmp_path)
    name = f"unreadable-{kind}"
    proc, out = _undying("run", ray_cluster, name, url, [*sets, "train.steps=20"])
    assert proc.returncode == 0, out[-5000:]
    root = f"{url}/{name}"
    before = _objects(root, options)
    # The store keeps failing every rank's reads past read_retry_s: exit 1, the checkpoint named.
    down = "chaos.faults=[" + ", ".join(f"{{kind: storage_throttle, rank: {r}, op: read, repeat: true}}"
                                        for r in range(4)) + "]"
    proc, out = _undying("run", ray_cluster, name, url, [*sets, "checkpoint.read_retry_s=3", down])
    assert proc.returncode == 1, out[-5000:]
    assert "checkpoint step 20 could not be read" in out and "SlowDown" in out
    assert "nothing was quarantined or deleted" in out
    assert _objects(root, options) == before
    # Both checkpoints corrupt: each is proven so and quarantined (manifests moved aside, every shard
    # kept), and the job stops instead of starting over from step 0.
    storage = Storage(root, options)
    for step in (10, 20):
        corrupt_shard(storage, step)
    shards = [p for p in _objects(root, options) if "/shard-" in p]
    proc, out = _undying("run", ray_cluster, name, url, sets)
    assert proc.returncode == 1, out[-5000:]
    assert "checkpoint step 20 is corrupt" in out and "checkpoint step 10 is corrupt" in out
    assert "no committed checkpoint can be restored" in out and "does not start from step 0 on its own" in out
    assert "fresh start" not in out
    assert [p for p in _objects(root, options) if "/shard-" in p] == shards
    assert Catalog(storage).committed_steps() == [] and Catalog(storage).quarantined_steps() == [10, 20]
