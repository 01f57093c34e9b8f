"""Checkpoints of parameter-server jobs, in one process (in-process ShardServers, a file store): a
PS checkpoint loads into the collective engine and back, restores servers bit for bit, and a save
that tears before its commit leaves no trace a reader would take and no damage."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.reader import read_manifest
from ckpt.shards import write_slices
from ckpt.storage import Storage
from orchestrator.rank.state import load_engine_state
from orchestrator.spec.job_spec import SpecError, validate_spec
from paramserver.checkpoint import (
    PSCheckpointError,
    PSJob,
    catalog,
    latest_committed_step,
    load_shard,
    restore_newest_intact,
    restore_servers,
    save_ps_checkpoint,
)
from paramserver.lockstep import PSSetup, build_in_process, run_lockstep
from paramserver.shard import NotAtCut
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import data_identity
from trainer.engine import Engine
from trainer.state_slices import assemble

MODEL = ModelConfig(preset="tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2, vocab_size=64, max_seq_len=32)
# Untied, with a vocabulary wide enough that a step's tokens leave some embedding bands untouched:
# bands count different lazy updates.
UNTIED = MODEL.model_copy(update={"tie_embeddings": False, "vocab_size": 512})
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=20, global_batch=8, micro_batch=2, grad_clip=None, lr=3e-3)
SMALL_PIECES = 2000  # bytes: cuts the embedding and the MLP matrices into row bands over the servers


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _ps(consistency: str, dp: int = 2, servers: int = 3) -> ParallelConfig:
    return ParallelConfig(dp=dp, mode="ps", servers=servers, consistency=consistency,
                          staleness=1 if consistency == "ssp" else None)


def _job(model: ModelConfig, parallel: ParallelConfig) -> PSJob:
    return PSJob("ps-ckpt", model, DATA, TRAIN, parallel, spec_hash="h", keep=3,
                 data_identity=data_identity(DATA, model.vocab_size))


def _step(setup: PSSetup, step: int) -> None:
    """One more step of every worker, round-robin (paramserver.lockstep's order), from any step."""
    for w, worker in enumerate(setup.workers):
        pulled = [server.pull(w, step, worker.rows_needed(step)) for server in setup.servers]
        for answer in pulled:
            worker.load(answer)
        _, tokens = worker.compute(step)
        for server, push in zip(setup.servers, worker.pushes(step, pulled, tokens), strict=True):
            server.push(push)


def _state(setup: PSSetup) -> dict[str, torch.Tensor]:
    return assemble([piece for server in setup.servers for piece in server.state_slices()])


def _load_engine(root: str, step: int) -> Engine:
    """A dp1 collective engine restored from `root`'s checkpoint `step` by a rank's own restore."""
    engine = Engine(MODEL, DATA, TRAIN, ParallelConfig(), rank=0, world_size=1)
    spec = SimpleNamespace(checkpoint_root=root, checkpoint=SimpleNamespace(storage_options={}, read_retry_s=0.0),
                           model=MODEL)
    load_engine_state(spec, engine, step)
    return engine


def test_a_bsp_ps_checkpoint_loads_into_the_collective_engine_exactly(tmp_path):
    root = str(tmp_path / "ps")
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("bsp"), SMALL_PIECES)
    run_lockstep(setup, 3)
    commit = save_ps_checkpoint(setup.servers, root, 3, job=_job(MODEL, _ps("bsp")))
    assert commit is not None and commit.step == 3 and latest_committed_step(root) == 3
    manifest = read_manifest(Catalog(Storage(root)), 3)
    assert manifest.state["ps"]["servers"] == 3 and manifest.layout["mode"] == "ps"
    assert manifest.state["engine"]["data"] == data_identity(DATA, MODEL.vocab_size)  # the engine checks it too
    engine = _load_engine(root, 3)
    assert engine.next_step == 3
    loaded, shards = assemble(engine.state_slices()), _state(setup)
    assert sorted(loaded) == sorted(shards) and any(name.endswith("/exp_avg_sq") for name in loaded)
    for name, value in loaded.items():
        assert torch.equal(value, shards[name]), name


def test_a_ps_checkpoint_loads_into_another_number_of_servers(tmp_path):
    root = str(tmp_path / "resharded")
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("bsp"), SMALL_PIECES)
    run_lockstep(setup, 2)
    save_ps_checkpoint(setup.servers, root, 2, job=_job(MODEL, _ps("bsp")))
    fewer = build_in_process(MODEL, DATA, TRAIN, _ps("bsp", servers=2))  # other servers, other row bands
    assert restore_servers(fewer.servers, root, 2) == [2, 2]
    saved, loaded = _state(setup), _state(fewer)
    assert sorted(saved) == sorted(loaded)
    assert all(torch.equal(value, saved[name]) for name, value in loaded.items())
    other = TRAIN.model_copy(update={"global_batch": 16})
    servers = build_in_process(MODEL, DATA, other, _ps("bsp", servers=2)).servers
    with pytest.raises(ValueError, match="train.global_batch = 8, this job 16: .*set train.global_batch back to 8"):
        restore_servers(servers, root, 2)


def test_a_collective_checkpoint_loads_into_servers_and_their_next_update_is_the_engines(tmp_path):
    root = str(tmp_path / "collective")
    engine = Engine(MODEL, DATA, TRAIN, ParallelConfig(), rank=0, world_size=1)
    for _ in range(3):
        engine.train_step()
    catalog = Catalog(Storage(root))
    receipt = write_slices(catalog.storage, 3, 0, engine.state_slices(), 0.0)
    committer = Committer(catalog, "collective", "h", keep=2)
    assert committer.on_receipt(receipt, {"engine": engine.state_meta()}, 1, 0, {"dp": 1},
                                lambda samples: {}) is not None
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("bsp"), SMALL_PIECES)
    assert restore_servers(setup.servers, root, 3) == [3, 3, 3]
    engine.train_step()
    _step(setup, 3)
    after, shards = assemble(engine.state_slices()), _state(setup)
    assert sorted(after) == sorted(shards)
    for name, value in after.items():
        torch.testing.assert_close(shards[name], value, rtol=0, atol=1e-6, msg=name)
    assert all(server.version == 4 for server in setup.servers)


def test_servers_restore_bit_for_bit_with_their_lazy_sparse_state(tmp_path):
    root, parallel = str(tmp_path / "asp"), _ps("asp", servers=2)
    first = build_in_process(UNTIED, DATA, TRAIN, parallel, SMALL_PIECES)
    run_lockstep(first, 3)
    save_ps_checkpoint(first.servers, root, 3, job=_job(UNTIED, parallel))
    second = build_in_process(UNTIED, DATA, TRAIN, parallel, SMALL_PIECES)
    assert restore_servers(second.servers, root, 3) == [6, 6]  # asp: one update per push, 2 workers x 3 steps
    saved = [piece for server in first.servers for piece in server.state_slices()]
    assert len({int(p.tensor[0]) for p in saved if p.name.endswith("/lazy_step")}) > 1
    for a, b in zip(saved, [piece for server in second.servers for piece in server.state_slices()], strict=True):
        assert a.key == b.key and torch.equal(a.tensor, b.tensor), a.name
    for server_a, server_b in zip(first.servers, second.servers, strict=True):
        assert {i: s.step for i, s in server_a.row_state.items()} == {i: s.step for i, s in server_b.row_state.items()}
        assert server_b.clocks.pushed == [3, 3]
    # The next step from the restored servers (with fresh workers) is the uninterrupted one.
    _step(first, 3)
    _step(second, 3)
    for name, value in _state(first).items():
        assert torch.equal(value, _state(second)[name]), name


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                out[os.path.relpath(os.path.join(folder, name), root)] = handle.read()
    return out


def _saved_at_two(root: str, job: PSJob) -> tuple[PSSetup, dict[str, torch.Tensor]]:
    """Servers of `job` trained two steps and saved at step 2 under `root`; their state then."""
    setup = build_in_process(MODEL, DATA, TRAIN, job.parallel, SMALL_PIECES)
    run_lockstep(setup, 2)
    save_ps_checkpoint(setup.servers, root, 2, job=job)
    return setup, _state(setup)


def test_a_torn_save_is_not_committed_and_never_damages_the_last_checkpoint(tmp_path):
    root, parallel = str(tmp_path / "torn"), _ps("bsp")
    job = _job(MODEL, parallel)
    setup, at_two = _saved_at_two(root, job)
    files_at_two = _files(root)
    assert save_ps_checkpoint(setup.servers, root, 2, job=job) is None  # committed already: nothing written
    for step in (2, 3):
        _step(setup, step)

    def crash(point: str, step: int) -> None:
        if point == "before_manifest_commit":
            raise RuntimeError("driver killed")

    with pytest.raises(RuntimeError, match="driver killed"):
        save_ps_checkpoint(setup.servers, root, 4, job=job, fault_point=crash)
    assert any(name.startswith("step-000000004/shard-") for name in _files(root))
    assert latest_committed_step(root) == 2
    assert all(_files(root)[name] == data for name, data in files_at_two.items())
    fresh = build_in_process(MODEL, DATA, TRAIN, parallel, SMALL_PIECES)
    restore_servers(fresh.servers, root, 2)
    assert all(torch.equal(value, at_two[name]) for name, value in _state(fresh).items())
    # A server short of the cut refuses; shards that do not cover the model are not committed.
    with pytest.raises(NotAtCut, match="not at step 5"):  # not a storage failure: the supervisor rolls back
        save_ps_checkpoint(setup.servers, root, 5, job=job)
    with pytest.raises(PSCheckpointError, match="not committed"):
        save_ps_checkpoint(setup.servers[:2], root, 4, job=job)
    assert latest_committed_step(root) == 2
    assert save_ps_checkpoint(setup.servers, root, 4, job=job).step == latest_committed_step(root) == 4


def _saved_at_two_and_four(root: str, job: PSJob) -> dict[str, torch.Tensor]:
    """Servers of `job` saved at steps 2 and 4 under `root`; their state at step 2."""
    setup, at_two = _saved_at_two(root, job)
    for step in (2, 3):
        _step(setup, step)
    save_ps_checkpoint(setup.servers, root, 4, job=job)
    return at_two


def test_a_corrupt_commit_is_quarantined_and_every_server_restores_the_next_older_one(tmp_path):
    from tests._checkpoints import flip_bit, shard_of

    root, parallel = str(tmp_path / "q"), _ps("bsp")
    at_two = _saved_at_two_and_four(root, _job(MODEL, parallel))
    cat = catalog(root)
    for step in (4, 2):
        name = next(n for n in cat.read_manifest(step).tensors if n.startswith("model/"))
        flip_bit(cat, step, shard_of(cat, step, name))  # a silent media error
        if step == 4:
            fresh = build_in_process(MODEL, DATA, TRAIN, parallel, SMALL_PIECES)
            assert restore_newest_intact(fresh.servers, root, 4) == 2
            assert all(torch.equal(value, at_two[name]) for name, value in _state(fresh).items())
            assert cat.committed_steps() == [2] and cat.quarantined_steps() == [4]  # its files kept as evidence
    with pytest.raises(PSCheckpointError, match=r"no committed checkpoint left .*steps \[2\] proved corrupt.*--fresh"):
        restore_newest_intact(fresh.servers, root, 2)
    assert cat.committed_steps() == [] and cat.quarantined_steps() == [2, 4]
    # A rerun finds nothing committed and the evidence kept: it does not start from step 0 unless --fresh.
    from types import SimpleNamespace

    from paramserver.restores import resume

    def rerun(fresh: bool) -> SimpleNamespace:
        return SimpleNamespace(ckpt=SimpleNamespace(root=root, storage_options=None, owner=None, fresh=fresh,
                                                  read_retry_s=0.0))
    with pytest.raises(PSCheckpointError, match=r"steps \[2, 4\] were quarantined.*--fresh"):
        resume(rerun(fresh=False))
    assert resume(rerun(fresh=True)) == 0


def test_a_proven_corrupt_commit_whose_quarantine_the_store_fails_is_kept_skipped_and_the_older_restored(
        tmp_path, monkeypatch):
    import errno

    from tests._checkpoints import flip_bit, shard_of

    root, parallel = str(tmp_path / "q"), _ps("bsp")
    at_two = _saved_at_two_and_four(root, _job(MODEL, parallel))
    cat = catalog(root)
    name = next(n for n in cat.read_manifest(4).tensors if n.startswith("model/"))
    flip_bit(cat, 4, shard_of(cat, 4, name))

    def failing_move(self, step):  # one 5xx as the manifest is moved aside
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Catalog, "quarantine", failing_move)
    fresh, skipped = build_in_process(MODEL, DATA, TRAIN, parallel, SMALL_PIECES), set()
    assert restore_newest_intact(fresh.servers, root, 4, skipped=skipped) == 2 and skipped == {4}
    assert all(torch.equal(value, at_two[name]) for name, value in _state(fresh).items())
    assert cat.committed_steps() == [2, 4]  # kept where it was: never restored by this run
    name = next(n for n in cat.read_manifest(2).tensors if n.startswith("model/"))
    flip_bit(cat, 2, shard_of(cat, 2, name))  # the older one too: nothing left, and a rerun would not help
    with pytest.raises(PSCheckpointError, match=r"steps \[4, 2\] proved corrupt but the store failed to move them "
                                                r"aside \(kept\), steps \[\] failed .*--fresh"):
        restore_newest_intact(fresh.servers, root, 4)


def test_retention_after_a_save_neither_counts_nor_deletes_the_commits_the_run_skipped(tmp_path):
    root, parallel = str(tmp_path / "keep"), _ps("bsp")
    job = _job(MODEL, parallel)
    job = PSJob(job.job, job.model, job.data, job.train, job.parallel, job.spec_hash, keep=1,
                data_identity=job.data_identity)
    setup, _ = _saved_at_two(root, job)
    for step in (2, 3):
        _step(setup, step)
    save_ps_checkpoint(setup.servers, root, 4, job=job)  # keep=1: step 2 goes
    assert catalog(root).committed_steps() == [4]
    for step in (4, 5):
        _step(setup, step)
    save_ps_checkpoint(setup.servers, root, 6, job=job, skipped={4})  # 4 is this run's skipped commit
    assert catalog(root).committed_steps() == [4, 6]


def test_a_commit_only_a_server_could_not_read_stays_committed_and_is_skipped(tmp_path, monkeypatch):
    """A server's stale view of the store (no manifest there) is no proof: the driver reads the step
    intact, so it stays committed; the servers restore the one before it, this run."""
    from ckpt.errors import corrupt_at
    from paramserver import checkpoint as ps_checkpoint

    root, parallel = str(tmp_path / "stale"), _ps("bsp")
    at_two = _saved_at_two_and_four(root, _job(MODEL, parallel))
    restore = ps_checkpoint.restore_servers

    tried = []

    def stale_at_four(servers, root, step, **kwargs):
        tried.append(step)
        if step == 4:
            raise corrupt_at("step 4 has no committed manifest", "manifest.json", 0, 0)
        return restore(servers, root, step, **kwargs)

    monkeypatch.setattr(ps_checkpoint, "restore_servers", stale_at_four)
    fresh, skipped = build_in_process(MODEL, DATA, TRAIN, parallel, SMALL_PIECES), set()
    assert restore_newest_intact(fresh.servers, root, 4, skipped=skipped) == 2 and skipped == {4}
    assert all(torch.equal(value, at_two[name]) for name, value in _state(fresh).items())
    assert catalog(root).committed_steps() == [2, 4] and catalog(root).quarantined_steps() == []
    assert restore_newest_intact(fresh.servers, root, 4, skipped=skipped) == 2 and tried == [4, 2, 2]  # not again


def test_a_server_that_cannot_write_its_shard_fails_that_save_not_the_job(tmp_path, monkeypatch):
    """Ray delivers a server's own error as RayTaskError: a storage error (the store refused the
    write) is a save that did not commit, the job goes on; any other error (a bug) is raised."""
    from ray.exceptions import RayTaskError

    from paramserver import checkpoint

    root, parallel = str(tmp_path / "refused"), _ps("bsp")
    job = _job(MODEL, parallel)

    def refused(servers, method, *args, **kwargs):
        raise RayTaskError(method, "traceback", OSError(28, "No space left on device"))

    monkeypatch.setattr(checkpoint, "_call", refused)
    with pytest.raises(PSCheckpointError, match="could not write its shard .OSError: .Errno 28. No space left"):
        save_ps_checkpoint([], root, 4, job=job)

    def buggy(servers, method, *args, **kwargs):
        raise RayTaskError(method, "traceback", KeyError("slices"))

    monkeypatch.setattr(checkpoint, "_call", buggy)
    with pytest.raises(RayTaskError):
        save_ps_checkpoint([], root, 4, job=job)
    assert latest_committed_step(root) is None


def test_a_root_the_store_lists_without_the_lease_fails_that_save_and_reads_as_no_commit_nowhere(tmp_path):
    """Under the driver's lease, a root the store lists empty (a bucket failover, a dropped mount) is an
    error: a save fails, the job goes on, and a restore does not read it as "start from step 0"."""
    from ckpt.catalog import RootNotListed
    from ckpt.errors import TransientStorageError
    from ckpt.ownership import OwnerLease

    root = tmp_path / "leased"
    lease = OwnerLease.claim(Storage(f"file://{root}"), "here", lease_s=600.0)  # no beat during the test
    try:
        root.rename(tmp_path / "away")
        with pytest.raises(PSCheckpointError, match="could not be listed, or the owner lease checked .RootNotListed"):
            save_ps_checkpoint([], str(root), 4, job=_job(MODEL, _ps("bsp")), owner=lease)
        with pytest.raises(TransientStorageError, match="listing the committed checkpoints") as err:
            latest_committed_step(str(root), owner=lease, read_retry_s=0.2)  # retried, as any store failure
        assert isinstance(err.value.__cause__, RootNotListed)
        assert latest_committed_step(str(root)) is None  # a reader without the lease: as before
        (tmp_path / "away").rename(root)
        assert latest_committed_step(str(root), owner=lease) is None  # listed whole: no commit yet
        lease._beat_at -= 1000  # its beats have not landed for a lease: OwnershipUncertain, a store failure
        with pytest.raises(PSCheckpointError, match="owner lease checked .OwnershipUncertain"):
            save_ps_checkpoint([], str(root), 4, job=_job(MODEL, _ps("bsp")), owner=lease)
    finally:
        lease.release()


def _ps_spec(checkpoint: dict) -> dict:
    return dict(name="ps", model={"preset": "tiny"}, data={"seq_len": 16},
                train={"steps": 2, "global_batch": 4, "grad_clip": None},
                parallel={"dp": 2, "mode": "ps", "servers": 2}, checkpoint={"url": "file:///tmp/x", **checkpoint})


def test_the_spec_refuses_checkpoint_options_ps_mode_does_not_run():
    with pytest.raises(SpecError) as err:
        validate_spec(_ps_spec({"every_seconds": 30, "async": True, "memory": {"enabled": True},
                                "commit_timeout_s": 30}))
    problems = {p.field: p.message for p in err.value.problems}
    assert set(problems) == {"checkpoint.every_steps", "checkpoint.async", "checkpoint.memory.enabled",
                             "checkpoint.commit_timeout_s"}
    assert "set checkpoint.async: false" in problems["checkpoint.async"]
    spec = validate_spec(_ps_spec({"every_steps": 5, "async": False}))
    assert spec.checkpoint.every_steps == 5


def test_ps_mode_defaults_to_a_waited_save_and_no_memory_level_where_collective_keeps_both():
    # Left unset, the checkpoint options ps mode cannot run take the values it runs.
    ps = validate_spec(_ps_spec({"every_steps": 5, "memory": {"every_steps": 2}}))
    assert not ps.checkpoint.async_ and not ps.checkpoint.memory.enabled and ps.checkpoint.memory.every_steps == 2
    collective = {**_ps_spec({"every_steps": 5}), "parallel": {"dp": 2}, "train": {"steps": 2, "global_batch": 4}}
    spec = validate_spec(collective)
    assert spec.checkpoint.async_ and spec.checkpoint.memory.enabled


def test_a_save_at_a_step_the_run_skipped_is_refused_and_writes_nothing(tmp_path):
    root, parallel = str(tmp_path / "skip"), _ps("bsp")
    job = _job(MODEL, parallel)
    setup, _ = _saved_at_two(root, job)
    before = _files(root)
    with pytest.raises(PSCheckpointError, match="committed by an earlier run"):
        save_ps_checkpoint(setup.servers, root, 2, job=job, skipped={2})  # not "committed already": not saved
    assert _files(root) == before


def test_a_stalled_manifest_creates_shards_survive_the_later_saves_garbage_collection(tmp_path, monkeypatch):
    """A create that failed with the store's errors may still land (a stalled request): the run remembers
    the step across saves, so a later save's GC does not take its shards for an orphan's."""
    root, parallel = str(tmp_path / "unsure"), _ps("bsp")
    job, unsure = _job(MODEL, parallel), set()
    setup, _ = _saved_at_two(root, job)
    for step in (2, 3):
        _step(setup, step)
    commit = Catalog.commit

    def stalled(self, **kwargs):
        raise TimeoutError("the store did not answer")  # as a client timeout: the request may still land

    monkeypatch.setattr(Catalog, "commit", stalled)
    with pytest.raises(PSCheckpointError, match="not committed"):
        save_ps_checkpoint(setup.servers, root, 4, job=job, unsure=unsure)
    assert unsure == {4}
    monkeypatch.setattr(Catalog, "commit", commit)
    for step in (4, 5):
        _step(setup, step)
    save_ps_checkpoint(setup.servers, root, 6, job=job, unsure=unsure)
    assert catalog(root).committed_steps() == [2, 6]
    assert any(name.startswith("step-000000004/shard-") for name in _files(root))  # not collected


def test_a_server_refuses_a_checkpoint_of_another_model_before_reading_it(tmp_path):
    # The same shapes, another head count: loaded, every tensor would fill the servers, cut anew into
    # heads, and train another attention without an error.
    from trainer.checkpoint_match import CheckpointMismatch

    root = str(tmp_path / "ps")
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("bsp"), SMALL_PIECES)
    run_lockstep(setup, 2)
    assert save_ps_checkpoint(setup.servers, root, 2, job=_job(MODEL, _ps("bsp"))) is not None
    other = build_in_process(MODEL.model_copy(update={"n_heads": 4, "n_kv_heads": 4}), DATA, TRAIN, _ps("bsp"),
                             SMALL_PIECES)
    with pytest.raises(CheckpointMismatch, match=r"checkpoint step 2 is of another model \(n_heads=2 \(the spec: 4\), "
                                                 r"n_kv_heads=2 \(the spec: 4\)\)"):
        load_shard(other.servers[0], root, 2)
