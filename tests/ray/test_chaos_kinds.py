"""One end-to-end run per wired fault kind on the real Ray test cluster (4 ranks, 40 steps, a save
every 10), each ending with the job's expected outcome, every committed checkpoint verifying
(the latest among them) and, since every run here completes on the reference's layout, the
reference's final loss bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt.catalog import Catalog
from ckpt.reader import verify_checkpoint
from ckpt.storage import Storage
from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray


def _run(ray_cluster, tmp_path: Path, name: str, faults: str) -> tuple[dict, str, Catalog]:
    proc, path = run_job(ray_cluster, tmp_path, name, [f"chaos.faults={faults}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return json.loads(path.read_text()), out, Catalog(Storage(f"file://{tmp_path}/ckpt/{name}"))


def _all_verify(catalog: Catalog, latest: int = 40) -> None:
    steps = catalog.committed_steps()
    assert steps and steps[-1] == latest, steps
    for step in steps:
        verify_checkpoint(catalog, step)


# Heavy (about 25 s on two cores): tests/unit/test_rank_loop_faults.py stops the rank before the poisoned
# step is reported or saved, tests/dist/test_chaos_nan_grad_ddp.py poisons real DDP ranks, and a failed
# rank recovers from the last commit as in the kill tests.
@pytest.mark.heavy
def test_nan_grad_fails_the_rank_and_recovers_from_the_last_commit(ray_cluster, tmp_path, reference):
    report, out, catalog = _run(ray_cluster, tmp_path, "nan", "[{kind: nan_grad, rank: 2, at_step: 25}]")
    [failure] = report["failures"]
    assert failure["kind"] == "nan_grad" and failure["rank"] == 2, out[-3000:]
    assert "non-finite gradient norm at step 25" in out
    assert "restored step 20" in out
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]


def test_storage_errors_on_a_shard_and_on_a_manifest_reply(ray_cluster, tmp_path, reference):
    # Rank 1 cannot write its shard of step 10: that save never commits. The manifest of
    # step 20 lands but its reply is "lost": the retried create finds our own manifest.
    report, out, catalog = _run(ray_cluster, tmp_path, "storerr", (
        "[{kind: storage_error, rank: 1, at_step: 10},"
        " {kind: storage_error, path: '*/manifest.json', when: after, at_step: 20}]"))
    assert report["failures"] == [], out[-3000:]
    assert "checkpoint step 10 will not be committed: rank 1 failed to write its shard" in out
    assert "storage_error (after) on the controller's write of" in out
    assert [c["step"] for c in report["checkpoints"]] == [20, 30, 40]
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]


def test_torn_shard_and_torn_manifest_never_commit(ray_cluster, tmp_path, reference):
    # A torn shard of rank 3 at step 10; at step 20 both manifest attempts are torn. Neither
    # save commits, no unreadable manifest is left where a reader would trust it.
    report, out, catalog = _run(ray_cluster, tmp_path, "torn", (
        "[{kind: torn_write, rank: 3, at_step: 10},"
        " {kind: torn_write, path: '*/manifest.json', at_step: 20, repeat: true}]"))
    assert report["failures"] == [], out[-3000:]
    assert "checkpoint step 10 will not be committed: rank 3 failed to write its shard" in out
    assert "checkpoint step 20 will not be committed: the manifest commit failed twice" in out
    assert [c["step"] for c in report["checkpoints"]] == [30, 40]
    assert not catalog.storage.exists(catalog.manifest_path(20))
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]


# Heavy (a whole job, about 30 s on two cores): tests/ray/test_long_saves.py runs the same fault in the default suite.
@pytest.mark.heavy
def test_storage_latency_on_a_shard_write_delays_that_save(ray_cluster, tmp_path, reference):
    report, out, catalog = _run(ray_cluster, tmp_path, "slowio",
                                "[{kind: storage_latency, rank: 0, delay_s: 1.5, at_step: 20}]")
    assert report["failures"] == [], out[-3000:]
    assert "storage_latency (latency) on rank 0's write of" in out
    saves = {c["step"]: c["total_s"] for c in report["checkpoints"]}
    assert sorted(saves) == [10, 20, 30, 40]
    assert saves[20] >= 1.5
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]


# Heavy (about 30 s on two cores): tests/unit/test_controller_faults.py's corrupt_shard test takes the
# same fault to a loud fallback at the next restore, and tests/unit/test_ckpt.py finds each corruption.
@pytest.mark.heavy
def test_corrupt_shard_is_found_at_restore_and_the_previous_checkpoint_is_used(ray_cluster, tmp_path, reference):
    report, out, catalog = _run(ray_cluster, tmp_path, "corrupt", (
        "[{kind: corrupt_shard, at_step: 20}, {kind: kill_rank, rank: 1, at_step: 25}]"))
    assert "corrupt_shard on committed step 20: bit" in out, out[-3000:]
    assert "checkpoint step 20 is corrupt" in out and "moved aside" in out
    assert "restored step 10" in out
    assert [f["kind"] for f in report["failures"]] == ["kill_rank"]
    assert [c["step"] for c in report["checkpoints"]] == [10, 20, 20, 30, 40]  # 20 saved and committed again
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]


def _writer_processes() -> list[int]:
    """PIDs of live checkpoint writer processes (`python -m ckpt.writer_child ...`) on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"ckpt.writer_child" in argv and (entry / "stat").read_text().split()[2] != "Z":
                pids.append(int(entry.name))
    return pids


# Heavy (about 40 s on two cores): tests/unit/test_ckpt_process_writer.py fails a child's write, kills a
# child mid-save and ends one with its parent; the faults' end-to-end runs above use writer threads.
@pytest.mark.heavy
def test_writer_processes_take_storage_faults_and_rank_kills_and_leave_nothing_behind(ray_cluster, tmp_path,
                                                                                     reference):
    # checkpoint.writer=process: each rank's shards are written by its own child process. Rank 1's
    # writer fails its shard of step 10 (a storage fault installed in the child); rank 2 is
    # killed at step 25 mid-training, and with it its writer; the job recovers from step 20.
    before = set(_writer_processes())
    proc, path = run_job(ray_cluster, tmp_path, "procw", [
        "checkpoint.writer=process",
        "chaos.faults=[{kind: storage_error, rank: 1, at_step: 10}, {kind: kill_rank, rank: 2, at_step: 25}]"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    report = json.loads(path.read_text())
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/procw"))
    assert "checkpoint step 10 will not be committed: rank 1 failed to write its shard" in out, out[-3000:]
    assert "storage_error" in out and "restored step 20" in out
    [failure] = report["failures"]
    assert failure["kind"] == "kill_rank" and failure["rank"] == 2
    assert [c["step"] for c in report["checkpoints"]] == [20, 30, 40]
    _all_verify(catalog)
    assert report["final_loss"] == reference["final_loss"]
    assert set(_writer_processes()) <= before  # every rank's writer is gone, the killed rank's too


@pytest.mark.heavy
def test_saves_that_keep_failing_fail_the_job_with_the_storage_error(ray_cluster, tmp_path):
    # Rank 1 cannot write its shards of steps 10, 20 and 30: checkpoint.max_failed_saves (3) saves
    # fail in a row, so the job stops with the storage error (exit 1) rather than train to step 40
    # with nothing durable.
    faults = ", ".join(f"{{kind: storage_error, rank: 1, at_step: {s}}}" for s in (10, 20, 30))
    proc, path = run_job(ray_cluster, tmp_path, "savefail", [f"chaos.faults=[{faults}]"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    report = json.loads(path.read_text())
    assert report["status"] == "failed" and report["error"].startswith(
        "checkpoint storage failing: 3 consecutive saves failed (steps 10, 20, 30; checkpoint.max_failed_saves=3) "
        "and nothing was committed in this run; the last, step 30: rank 1 failed to write its shard"), report["error"]
    assert "InjectedStorageError" in report["error"] and report["checkpoints"] == []
    assert max(p["step"] for p in report["losses"]) < 40, "it trained on to the end"
    assert Catalog(Storage(f"file://{tmp_path}/ckpt/savefail")).committed_steps() == []
