"""Restore under a failing store, with the fake worker group: only proven corruption is quarantined
or fallen back from; a store that keeps failing, or checkpoints that all fail, fail the job naming
them with nothing deleted; the job never starts from step 0 on its own (`--fresh` does). Also the
rank's side: its `op: read` storage faults act on its restore reads, which wait a short outage out."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from chaos.corrupt import corrupt_shard
from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint, TransientStorageError
from ckpt.manifest import step_dir
from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.controller.machine import Controller
from orchestrator.controller.restore_policy import fresh_problem
from orchestrator.rank.state import load_engine_state, restore_storage_setup
from tests._checkpoints import commit_trained_engine, tiny_engine
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)
from trainer.checkpoint_match import CheckpointMismatch
from trainer.urls import RangeIgnored


class FailingRestore(FakeWorkerGroup):
    """A fake whose ranks' restore of a step raises what a real rank would (Ray re-raises it as is)."""

    def __init__(self, *args, errors: dict[int, BaseException], **kwargs):
        super().__init__(*args, **kwargs)
        self.errors = errors
        self.restored: list[int | None] = []

    def restore_all(self, step, dp, timeout_s, faults=None):
        self.restored.append(step)
        if step in self.errors:
            raise self.errors[step]
        return super().restore_all(step, dp, timeout_s, faults)


def _finished_job(tmp_path, rendezvous, **over):
    """Checkpoints 20 and 30 of a 30-step job; the spec of its 40-step continuation."""
    spec = _spec(tmp_path, **over)
    assert _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, []).run() \
        .status == "succeeded"
    return _spec(tmp_path, train={"steps": 40, "global_batch": 4, "micro_batch": 1}, **over)


def _run(spec, workers, rendezvous, fresh: bool = False):
    lines: list[str] = []
    ctl = Controller(spec, workers, rendezvous, Catalog(Storage(spec.checkpoint_root)), JobMetrics(spec.name),
                     printer=lines.append, poll_s=0.001, release_timeout_s=0.5, fresh=fresh,
                     commit_lane=False)
    return ctl, ctl.run(), "\n".join(lines)


def _files(spec) -> list[str]:
    root = Storage(spec.checkpoint_root)
    return sorted(path for path in root.fs.find(root.root))


@pytest.mark.parametrize("error, words", [
    # the store kept failing past the budget
    (TransientStorageError("step 30: bytes 0..64 of shard-r00000.bin: the store kept failing for 120.0 s "
                           "(checkpoint.read_retry_s=120): OSError: [Errno 16] Please reduce your request rate."),
     ("checkpoint step 30 could not be read", "Please reduce your request rate")),
    # a store (or proxy) that ignores Range: every rerun would meet it again, so no recovery loop either
    (RangeIgnored("step-000000030/shard-r00000.bin: the store answered 4096 bytes for the 64-byte range at 0: it "
                  "ignores HTTP Range requests"), ("ignores HTTP Range requests",)),
    # a checkpoint of another model (the driver's check could not read its manifest): every restore
    # would refuse it again, and an older step was trained by the same model
    (CheckpointMismatch("checkpoint step 30 is of another model (n_layers=8 (the spec: 4)): resume with the spec "
                        "it was trained with"), ("checkpoint step 30 is of another model",)),
])
def test_a_restore_that_proves_nothing_fails_the_job_at_once_naming_it_and_deletes_nothing(tmp_path, rendezvous,
                                                                                          error, words):
    spec = _finished_job(tmp_path, rendezvous)
    before = _files(spec)
    workers = FailingRestore(rendezvous, Storage(spec.checkpoint_root), errors={30: error})
    ctl, report, text = _run(spec, workers, rendezvous)
    assert report.status == "failed" and workers.restored == [30]  # no fallback to 20, no step 0, no loop
    assert all(w in report.error for w in words) and "nothing was quarantined or deleted" in report.error
    assert _files(spec) == before and ctl.catalog.committed_steps() == [20, 30]


def test_a_newer_undying_s_manifest_fails_the_job_naming_it_and_moves_nothing(tmp_path, rendezvous):
    # Step 30's manifest is this schema plus a field a newer release added: not damage.
    import json

    spec = _finished_job(tmp_path, rendezvous)
    catalog = Catalog(Storage(spec.checkpoint_root))
    path = catalog.manifest_path(30)
    newer = json.dumps(dict(json.loads(catalog.storage.read(path)), compression="zstd")).encode()
    catalog.storage.remove(path)
    catalog.storage.write_immutable(path, newer)
    before = _files(spec)
    workers = FailingRestore(rendezvous, Storage(spec.checkpoint_root), errors={})
    ctl, report, text = _run(spec, workers, rendezvous)
    assert report.status == "failed" and workers.restored == []  # refused before any rank read
    assert "fields this undying does not know (compression)" in report.error
    assert "newer undying" in report.error and "nothing was quarantined or deleted" in report.error
    assert _files(spec) == before and catalog.storage.read(path) == newer


def test_a_verification_that_meets_transient_errors_never_moves_a_manifest(tmp_path, rendezvous):
    # A rank proved step 30 corrupt; the controller's own verification is throttled for longer than
    # its budget, which proves nothing: 30 stays committed, this run only skips it.
    throttled = {"kind": "storage_throttle", "op": "read", "path": "*/shard-*", "repeat": True}
    _finished_job(tmp_path, rendezvous)
    spec = _spec(tmp_path, train={"steps": 40, "global_batch": 4, "micro_batch": 1}, chaos={"faults": [throttled]},
                 checkpoint={"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2, "read_retry_s": 0.3})
    workers = FailingRestore(rendezvous, Storage(spec.checkpoint_root),
                             errors={30: CorruptCheckpoint("step 30: checksum mismatch in shard-r00001.bin")})
    started = time.monotonic()
    ctl, report, text = _run(spec, workers, rendezvous)
    assert time.monotonic() - started >= 0.3  # the verification waited its budget out
    assert "checkpoint step 30 is corrupt" in text and "without proving corruption" in text
    assert "stays committed" in text and "restored step 20" in text
    assert not list((tmp_path / "ckpt" / "unit" / step_dir(30)).glob("manifest.corrupt-*"))
    assert (tmp_path / "ckpt" / "unit" / step_dir(30) / "manifest.json").exists()
    assert report.status == "succeeded", report.error


def test_every_checkpoint_corrupt_fails_the_job_naming_them_and_a_rerun_never_starts_over(tmp_path, rendezvous):
    spec = _finished_job(tmp_path, rendezvous)
    storage = Storage(spec.checkpoint_root)
    for step in (20, 30):
        corrupt_shard(storage, step)
    shards = [p for p in _files(spec) if "/shard-" in p]
    workers = FakeWorkerGroup(rendezvous, storage)
    workers.verify_restore = True  # the ranks read the checkpoint whole and find the flipped bits
    ctl, report, text = _run(spec, workers, rendezvous)
    assert report.status == "failed"
    assert "checkpoint step 30 is corrupt" in text and "checkpoint step 20 is corrupt" in text  # loudly, each
    assert "no committed checkpoint can be restored (step 30: corrupt" in report.error and "step 20: corrupt" in \
        report.error and "does not start from step 0 on its own" in report.error
    assert [p for p in _files(spec) if "/shard-" in p] == shards  # quarantine moves manifests, deletes nothing
    # Both manifests were moved aside: a plain rerun finds nothing committed, and still refuses step 0.
    workers = FailingRestore(rendezvous, storage, errors={})
    ctl, report, text = _run(spec, workers, rendezvous)
    assert report.status == "failed" and workers.restored == []
    assert "were quarantined as corrupt" in report.error and "[20, 30]" in report.error and "--fresh" in report.error
    assert fresh_problem(spec) is None
    ctl, report, text = _run(spec, FakeWorkerGroup(rendezvous, storage), rendezvous, fresh=True)
    assert report.status == "succeeded", report.error
    assert "fresh start (no committed checkpoint)" in text and report.final_step == 40


def test_fresh_is_refused_while_committed_checkpoints_are_in_its_way(tmp_path, rendezvous):
    spec = _finished_job(tmp_path, rendezvous)
    problem = fresh_problem(spec)
    assert "holds committed checkpoints (steps [20, 30])" in problem and "resume from step 30" in problem
    assert "--set name=" in problem


def _rank_spec(root: str, read_retry_s: float):
    from trainer.config import ModelConfig

    return SimpleNamespace(checkpoint_root=root, chaos=SimpleNamespace(seed=0), model=ModelConfig(preset="tiny"),
                           checkpoint=SimpleNamespace(storage_options={}, read_retry_s=read_retry_s))


@pytest.mark.parametrize("kind", ["storage_error", "storage_throttle"])
def test_a_ranks_restore_reads_wait_out_a_short_outage_and_load_the_checkpoint(tmp_path, kind):
    stand_in, source = commit_trained_engine(f"file://{tmp_path}/job")
    spec = _rank_spec(stand_in.checkpoint_root, read_retry_s=30.0)
    outage = [{"kind": kind, "rank": 0, "op": "read", "duration_s": 0.4, "id": 3},
              {"kind": kind, "rank": 1, "op": "read", "duration_s": 60}]  # another rank's: not ours
    notices: list[dict] = []
    engine = tiny_engine()
    started = time.monotonic()
    load_engine_state(spec, engine, 2, storage_setup=restore_storage_setup(spec, outage, 0, notices.append))
    assert time.monotonic() - started >= 0.4
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    assert notices and {(n["fault_id"], n["kind"], n["rank"], n["op"]) for n in notices} == {(3, kind, 0, "read")}


def test_a_rank_refuses_a_checkpoint_of_another_model_before_reading_it(tmp_path):
    # Step 2 was saved by a model with twice the blocks: loaded, this spec's model would take the
    # tensors it names (the first half) and train on without an error.
    from ckpt.manifest import MANIFEST_NAME, step_dir
    from ckpt.storage import durable_bytes_read
    from trainer.checkpoint_match import CheckpointMismatch
    from trainer.config import ModelConfig

    deeper = ModelConfig(preset="tiny", n_layers=8).architecture()
    stand_in, _ = commit_trained_engine(f"file://{tmp_path}/job", model=deeper)
    spec = _rank_spec(stand_in.checkpoint_root, read_retry_s=1.0)
    before = durable_bytes_read()
    with pytest.raises(CheckpointMismatch, match=r"checkpoint step 2 is of another model \(n_layers=8 \(the spec: "
                                                 r"4\)\): resume with the spec it was trained with"):
        load_engine_state(spec, tiny_engine(), 2)
    storage = Storage(stand_in.checkpoint_root)
    manifest_bytes = storage.fs.size(storage.path(step_dir(2), MANIFEST_NAME))
    assert durable_bytes_read() - before <= manifest_bytes  # refused on the manifest: no shard byte read


def test_a_ranks_restore_reads_give_up_after_read_retry_s(tmp_path):
    stand_in, _ = commit_trained_engine(f"file://{tmp_path}/job")
    spec = _rank_spec(stand_in.checkpoint_root, read_retry_s=0.2)
    outage = [{"kind": "storage_throttle", "rank": 0, "op": "read", "duration_s": 60}]
    with pytest.raises(TransientStorageError, match=r"read_retry_s=0.2\): InjectedThrottle.*\(S3 SlowDown, HTTP 503\)"):
        load_engine_state(spec, tiny_engine(), 2, storage_setup=restore_storage_setup(spec, outage, 0, print))
    assert Catalog(Storage(stand_in.checkpoint_root)).committed_steps() == [2]
    assert restore_storage_setup(spec, [{"kind": "storage_error", "rank": 0, "op": "write"}], 0, print) is None


def test_undying_run_fresh_exits_2_naming_the_committed_checkpoints_and_touches_nothing(tmp_path, rendezvous,
                                                                                      capsys):
    from orchestrator.cli.main import main
    from tests.ray.jobs import ROOT

    spec = _finished_job(tmp_path, rendezvous)
    before = _files(spec)
    code = main(["run", str(ROOT / "examples/demo.yaml"), "--set", "name=unit", "--set",
                 f"checkpoint.url=file://{tmp_path}/ckpt", "--fresh"])
    err = capsys.readouterr().err
    assert code == 2 and "--fresh:" in err and "steps [20, 30]" in err, err
    assert _files(spec) == before
