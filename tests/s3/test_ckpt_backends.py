"""One checkpoint test suite, three storages: file://, memory:// and a real S3 server (SeaweedFS).

Writes shards through the real writer, commits the manifest by exclusive create, reads back,
applies retention and garbage collection, and falls back past a damaged shard, the same way
on every backend (the `backend` fixture, tests/s3/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.process_writer import ProcessShardWriter, ShardWriteFailed
from ckpt.reader import CorruptCheckpoint, load_checkpoint, newest_loadable
from ckpt.shards import write_shard
from ckpt.storage import AlreadyCommitted, Storage
from tests._checkpoints import flip_bit, make_state, save_checkpoint, shard_of, shard_path
from trainer.state_slices import whole


def _catalog(backend) -> Catalog:
    return Catalog(Storage(backend.url, backend.storage_options))


def test_round_trip_is_exact_for_every_dtype(backend):
    catalog = _catalog(backend)
    state = make_state(1)
    save_checkpoint(catalog, 10, state)
    fresh = _catalog(backend)  # another process's view: nothing cached
    tensors, manifest = load_checkpoint(fresh, 10)
    assert manifest.step == 10 and manifest.state["engine"]["next_step"] == 10
    assert set(tensors) == set(state)
    for name, t in state.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name


def test_only_committed_manifests_count(backend):
    catalog = _catalog(backend)
    save_checkpoint(catalog, 10, make_state())
    write_shard(catalog.storage, 20, 0, make_state(1), blocking_s=0.0)  # a save that never committed
    assert catalog.all_steps() == [10, 20]
    assert catalog.committed_steps() == [10]
    assert catalog.latest() == 10
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(catalog, 20)


def test_manifest_create_is_exclusive_and_idempotent(backend):
    storage = _catalog(backend).storage
    path = storage.path(step_dir(5), "manifest.json")
    storage.create_exclusive(path, b'{"first": 1}')
    storage.create_exclusive(path, b'{"first": 1}')  # a retry that finds its own bytes: success
    with pytest.raises(AlreadyCommitted):
        storage.create_exclusive(path, b'{"second": 2}')
    assert storage.read(path) == b'{"first": 1}'
    assert storage.listdir(storage.path(step_dir(5))) == ["manifest.json"]  # no temp file left behind


def test_recommit_agrees_and_a_different_commit_is_refused(backend):
    catalog = _catalog(backend)
    state = make_state(2)
    save_checkpoint(catalog, 10, state)
    save_checkpoint(catalog, 10, state)  # the controller retried after the commit had landed
    assert catalog.committed_steps() == [10]
    # A second writer's receipts for step 10 (its shard bytes differ; written elsewhere here
    # so that step 10's own shards stay intact and readable).
    theirs = [write_shard(catalog.storage, 99, 0, make_state(3), blocking_s=0.0)]
    with pytest.raises(AlreadyCommitted, match="different shards"):
        catalog.commit(job="j", step=10, generation=1, layout={"dp": 1}, spec_hash="h", receipts=theirs,
                       state={"engine": {"next_step": 10}})
    tensors, manifest = load_checkpoint(catalog, 10)
    assert manifest.generation == 0 and torch.equal(tensors["model/w"], state["model/w"])


def test_corrupt_shard_is_detected_and_newest_loadable_falls_back(backend):
    catalog = _catalog(backend)
    save_checkpoint(catalog, 10, make_state(0))
    save_checkpoint(catalog, 20, make_state(1))
    flip_bit(catalog, 20, shard_of(catalog, 20, "model/w"))
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(catalog, 20)
    skipped = []
    assert newest_loadable(catalog, on_fallback=lambda step, err: skipped.append(step)) == 10
    assert skipped == [20]


def test_missing_shard_is_corrupt(backend):
    catalog = _catalog(backend)
    save_checkpoint(catalog, 10, make_state())
    catalog.storage.remove(shard_path(catalog, 10, "shard-r00001.bin"))
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(catalog, 10)


def test_retention_keeps_newest_and_gc_removes_orphans(backend):
    catalog = _catalog(backend)
    for step in (10, 20, 30, 40):
        save_checkpoint(catalog, step, make_state(step))
    write_shard(catalog.storage, 35, 0, make_state(), blocking_s=0.0)  # unfinished, older than the newest
    write_shard(catalog.storage, 45, 0, make_state(), blocking_s=0.0)  # unfinished, may still commit
    assert catalog.apply_retention(keep=2) == [10, 20]
    assert catalog.committed_steps() == [30, 40]
    assert catalog.collect_garbage() == [35]
    # Deleted directories are gone from listings too (SeaweedFS keeps emptied directories
    # as prefixes unless their marker is deleted).
    assert _catalog(backend).all_steps() == [30, 40, 45]
    assert catalog.apply_retention(keep=0) == [30]  # keep < 1 still keeps the newest committed
    assert catalog.latest() == 40
    tensors, _ = load_checkpoint(catalog, 40)
    assert torch.equal(tensors["model/w"], make_state(40)["model/w"])


def test_gc_plan_protects_in_flight_saves_and_deletes_nothing_itself(backend):
    catalog = _catalog(backend)
    for step in (10, 20, 30):
        save_checkpoint(catalog, step, make_state(step))
    for step in (15, 25):
        write_shard(catalog.storage, step, 0, make_state(), blocking_s=0.0)
    plan = catalog.gc_plan(keep=1, in_flight={25})
    assert (plan.expired, plan.orphans) == ([10, 20], [15])
    assert catalog.all_steps() == [10, 15, 20, 25, 30]  # planning deletes nothing
    catalog.apply_gc(plan)
    catalog.apply_gc(plan)  # a second cleaner racing the first finds everything gone: no error
    assert catalog.all_steps() == [25, 30]


def test_a_second_storage_sees_files_the_first_wrote_after_it_listed(backend):
    reader = _catalog(backend)
    writer = _catalog(backend)
    assert reader.storage.fs is not writer.storage.fs  # no shared, cached filesystem instance
    save_checkpoint(writer, 10, make_state())
    assert reader.committed_steps() == [10]  # the reader has listed (and so cached) the root
    write_shard(writer.storage, 20, 0, make_state(1), blocking_s=0.0)
    assert reader.all_steps() == [10, 20]
    assert reader.storage.listdir(reader.storage.path(step_dir(20))) == ["shard-r00000.bin"]
    save_checkpoint(writer, 20, make_state(1))  # the manifest lands in a directory the reader has cached
    assert reader.storage.exists(reader.manifest_path(20))
    assert reader.committed_steps() == [10, 20]
    assert reader.latest() == 20


def test_atomic_writer_publishes_whole_files_only(backend):
    storage = _catalog(backend).storage
    path = storage.path(step_dir(1), "shard-r00000.bin")
    with pytest.raises(RuntimeError, match="rank died"), storage.atomic_writer(path) as f:
        f.write(b"x" * 1000)
        raise RuntimeError("rank died mid-write")
    assert not storage.exists(path)
    with storage.atomic_writer(path) as f:
        f.write(b"a" * 10)
        f.write(b"b" * 10)
    assert storage.read(path) == b"a" * 10 + b"b" * 10
    assert storage.listdir(storage.path(step_dir(1))) == ["shard-r00000.bin"]


def test_a_writer_process_saves_to_s3_with_the_jobs_storage_options(s3_backend):
    """checkpoint.writer=process on a real S3 server: the child builds its own client from the
    storage options, its shards load back exactly, and a write error comes back as a save error."""
    state = make_state(3)
    receipts, errors = [], []
    writer = ProcessShardWriter(s3_backend.url, s3_backend.storage_options, 0,
                                lambda receipt, extra: receipts.append((receipt, extra)),
                                lambda step, err: errors.append((step, err)))
    writer.save(10, [whole(name, t) for name, t in state.items()], {"engine": {"next_step": 10}})
    writer.flush()
    assert not errors and [r.step for r, _ in receipts] == [10]
    catalog = _catalog(s3_backend)
    catalog.commit(job="j", step=10, generation=0, layout={}, spec_hash="h", receipts=[receipts[0][0]],
                   state=receipts[0][1])
    tensors, _ = load_checkpoint(_catalog(s3_backend), 10)
    assert all(torch.equal(tensors[name], t) for name, t in state.items())

    wrong = dict(s3_backend.storage_options, secret="not-the-secret")
    writer = ProcessShardWriter(s3_backend.url, wrong, 0, lambda r, e: receipts.append(r),
                                lambda step, err: errors.append((step, err)))
    writer.save(11, [whole(name, t) for name, t in state.items()], {})
    writer.flush()
    assert [(s, type(e)) for s, e in errors] == [(11, ShardWriteFailed)] and len(receipts) == 1
