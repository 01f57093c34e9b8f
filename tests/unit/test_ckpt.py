"""Checkpoint format, atomic commit, verified reads, fallback and retention (no processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.reader import CorruptCheckpoint, load_checkpoint, newest_loadable
from ckpt.shards import owned_by, write_shard
from ckpt.storage import AlreadyCommitted, Storage
from ckpt.writer import ShardWriter


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(8, 4, generator=g),
        "model/b": torch.randn(4, generator=g),
        "optim/w/step": torch.tensor(3.0),
        "model/half": torch.randn(5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
    }


def _save(catalog: Catalog, step: int, state: dict, world: int = 3) -> None:
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    receipts = []
    for rank in range(world):
        mine = {n: state[n] for n in owned_by(rank, world, sizes)}
        receipts.append(write_shard(catalog.storage, step, rank, mine, blocking_s=0.0))
    catalog.commit(job="j", step=step, generation=0, layout={"dp": world}, spec_hash="h",
                   receipts=receipts, state={"engine": {"next_step": step}})


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    return Catalog(Storage(f"file://{tmp_path}/ckpt/job"))


def test_owned_by_writes_each_tensor_once_and_balances_bytes():
    sizes = {f"t{i}": 100 * (i + 1) for i in range(10)}
    owners = [owned_by(r, 4, sizes) for r in range(4)]
    assert set().union(*owners) == set(sizes)
    assert sum(len(o) for o in owners) == len(sizes)
    loads = [sum(sizes[n] for n in o) for o in owners]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_round_trip_is_exact_for_every_dtype(catalog):
    state = _state()
    _save(catalog, 10, state)
    tensors, manifest = load_checkpoint(catalog, 10)
    assert manifest.step == 10 and manifest.state["engine"]["next_step"] == 10
    for name, t in state.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name


def test_only_committed_manifests_count(catalog):
    _save(catalog, 10, _state())
    write_shard(catalog.storage, 20, 0, _state(1), blocking_s=0.0)  # a save that never committed
    assert catalog.all_steps() == [10, 20]
    assert catalog.committed_steps() == [10]
    assert catalog.latest() == 10


def test_manifest_create_is_exclusive(catalog):
    path = catalog.manifest_path(5)
    catalog.storage.create_exclusive(path, b"{}")
    with pytest.raises(AlreadyCommitted):
        catalog.storage.create_exclusive(path, b"other")
    assert catalog.storage.read(path) == b"{}"
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]


def test_recommit_of_the_same_checkpoint_is_idempotent(catalog):
    state = _state()
    _save(catalog, 10, state)
    _save(catalog, 10, state)  # a retried commit of identical shards reads back and agrees
    assert catalog.committed_steps() == [10]


def test_corrupt_shard_is_detected_and_load_falls_back(catalog):
    _save(catalog, 10, _state(0))
    _save(catalog, 20, _state(1))
    shard = os.path.join(catalog.storage.root, step_dir(20), "shard-r00000.bin")
    with open(shard, "r+b") as f:
        data = bytearray(f.read())
        data[3] ^= 0x40
        f.seek(0)
        f.write(bytes(data))
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(catalog, 20)
    skipped = []
    assert newest_loadable(catalog, on_fallback=lambda s, e: skipped.append(s)) == 10
    assert skipped == [20]


def test_missing_shard_is_corrupt(catalog):
    _save(catalog, 10, _state())
    os.remove(os.path.join(catalog.storage.root, step_dir(10), "shard-r00001.bin"))
    with pytest.raises(CorruptCheckpoint):
        load_checkpoint(catalog, 10)


def test_retention_keeps_newest_and_gc_removes_orphans(catalog):
    for step in (10, 20, 30, 40):
        _save(catalog, step, _state(step))
    write_shard(catalog.storage, 35, 0, _state(), blocking_s=0.0)
    assert catalog.apply_retention(keep=2) == [10, 20]
    assert catalog.committed_steps() == [30, 40]
    assert catalog.collect_garbage() == [35]
    assert catalog.all_steps() == [30, 40]
    assert catalog.apply_retention(keep=1) == [30]
    assert catalog.latest() == 40


def test_manifest_is_json_with_chunks_and_checksums(catalog):
    _save(catalog, 10, _state())
    doc = json.loads(catalog.storage.read(catalog.manifest_path(10)))
    assert doc["schema_version"] == 1
    chunk = doc["tensors"]["model/w"]["chunks"][0]
    assert {"offsets", "lengths", "file", "byte_offset", "nbytes", "crc32"} <= set(chunk)
    assert chunk["lengths"] == [8, 4]


def test_async_writer_stages_then_reports_receipt(catalog):
    receipts, errors = [], []
    writer = ShardWriter(catalog.storage, 0, lambda r, extra: receipts.append((r, extra)),
                         lambda s, e: errors.append(e), async_save=True)
    state = _state()
    blocking = writer.save(7, state, {"engine": {"next_step": 7}})
    state["model/w"].add_(1.0)  # training goes on; the staged snapshot must not change
    blocking2 = writer.save(8, state, {})  # waits for the first write: at most one in flight
    writer.flush()
    assert not errors and [r.step for r, _ in receipts] == [7, 8]
    assert writer.waited in (0, 1) and blocking >= 0 and blocking2 >= 0
    catalog.commit(job="j", step=7, generation=0, layout={}, spec_hash="h",
                   receipts=[receipts[0][0]], state=receipts[0][1])
    tensors, _ = load_checkpoint(catalog, 7)
    assert torch.equal(tensors["model/w"], _state()["model/w"])


def test_memory_filesystem_commit(tmp_path):
    cat = Catalog(Storage("memory://undying-test/job"))
    _save(cat, 3, _state())
    assert cat.latest() == 3
    with pytest.raises(AlreadyCommitted):
        cat.storage.create_exclusive(cat.manifest_path(3), b"{}")
