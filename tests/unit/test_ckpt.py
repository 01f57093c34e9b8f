"""Checkpoint format, atomic commit, verified reads, fallback and retention (no processes)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import zlib

import pytest
import torch

from ckpt.blocks import block_crcs
from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.errors import IncompleteCheckpoint, UnsupportedManifest
from ckpt.manifest import step_dir
from ckpt.reader import CorruptCheckpoint, load_checkpoint, newest_loadable, read_slices, verify_checkpoint
from ckpt.shards import _ChunkBytes, owned_by, slices_to_write, write_shard, write_slices
from ckpt.storage import AlreadyCommitted, Storage
from ckpt.writer import WRITER_NICE, ShardWriter
from tests._checkpoints import feed, shard_receipts
from trainer.state_slices import TensorSlice, assemble, whole


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
    receipts = shard_receipts(catalog, step, state, world)
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


def test_a_create_the_disk_refuses_leaves_no_temporary_file_and_a_retry_makes_its_entry_durable(catalog, monkeypatch):
    import errno

    from ckpt import storage as storage_module

    path, real_fsync, synced = catalog.manifest_path(6), os.fsync, []

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        catalog.storage.create_exclusive(path, b"{}")
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp-" in n]
    monkeypatch.setattr(os, "fsync", real_fsync)

    def flaky_directory_sync(directory):  # fails once
        synced.append(directory)
        if len(synced) == 1:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(storage_module, "_fsync_dir", flaky_directory_sync)
    with pytest.raises(OSError, match="Input/output error"):  # linked, but its directory's fsync failed
        catalog.storage.create_exclusive(path, b"{}")
    catalog.storage.create_exclusive(path, b"{}")  # the retry finds its own bytes: syncs the directory now
    # The retry syncs the manifest's entry and the new step directory's own entry in the root.
    assert synced == [os.path.dirname(path), os.path.dirname(path), os.path.dirname(os.path.dirname(path))]


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


def test_a_quarantined_checkpoint_can_be_saved_again_without_touching_its_files(catalog):
    _save(catalog, 10, _state(0))
    _save(catalog, 20, _state(1))
    directory = os.path.join(catalog.storage.root, step_dir(20))
    old_shard = os.path.join(directory, "shard-r00000.bin")
    with open(old_shard, "r+b") as f:
        f.seek(3)
        f.write(b"\xff")
    aside = catalog.quarantine(20)
    assert catalog.committed_steps() == [10] and catalog.storage.exists(aside)
    with open(old_shard, "rb") as f:
        evidence = f.read()
    # The step is saved again under another save tag: new files, the old ones untouched.
    state = _state(2)
    receipt = write_slices(catalog.storage, 20, 0, [whole(n, t) for n, t in state.items()], 0.0, tag="runBg3")
    catalog.commit(job="j", step=20, generation=3, layout={"dp": 1}, spec_hash="h", receipts=[receipt],
                   state={"engine": {"next_step": 20}})
    assert receipt.file == "shard-runBg3-r00000.bin"
    with open(old_shard, "rb") as f:
        assert f.read() == evidence
    loaded, _ = load_checkpoint(catalog, 20)
    assert all(torch.equal(loaded[n], t) for n, t in state.items())


def test_gc_keeps_a_quarantined_checkpoint_s_files_as_evidence(catalog):
    for step in (10, 20, 30):
        _save(catalog, step, _state(step))
    aside = catalog.quarantine(20)
    write_shard(catalog.storage, 25, 0, _state(), blocking_s=0.0)  # an unfinished save: garbage
    assert catalog.gc_plan(keep=5).orphans == [25]
    assert catalog.collect_garbage() == [25]
    assert catalog.all_steps() == [10, 20, 30] and catalog.storage.exists(aside)
    assert catalog.quarantined_steps() == [20]


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


def test_manifest_is_json_with_chunks_and_block_checksums(catalog):
    _save(catalog, 10, _state())
    doc = json.loads(catalog.storage.read(catalog.manifest_path(10)))
    assert doc["schema_version"] == 2
    chunk = doc["tensors"]["model/w"]["chunks"][0]
    assert {"offsets", "lengths", "file", "byte_offset", "nbytes", "block_bytes", "block_crc32"} <= set(chunk)
    assert chunk["lengths"] == [8, 4] and chunk["byte_offset"] % 64 == 0
    assert len(chunk["block_crc32"]) == 1  # a small chunk is one block


def test_a_manifest_of_another_schema_version_is_refused_clearly(catalog):
    _save(catalog, 10, _state())
    path = catalog.manifest_path(10)
    doc = json.loads(catalog.storage.read(path))
    old = {**doc, "schema_version": 1}
    for chunks in (e["chunks"] for e in old["tensors"].values()):  # what version 1 wrote
        for c in chunks:
            c["crc32"] = c.pop("block_crc32")[0]
            del c["block_bytes"]
    with open(path, "w") as f:
        json.dump(old, f)
    with pytest.raises(UnsupportedManifest, match="schema_version 1, but this undying reads schema_version 2"):
        load_checkpoint(catalog, 10)
    with pytest.raises(UnsupportedManifest):  # not a corrupt checkpoint to skip silently
        newest_loadable(catalog)


def test_async_writer_stages_then_reports_receipt(catalog):
    receipts, errors = [], []
    writer = ShardWriter(catalog.storage, 0, lambda r, extra: receipts.append((r, extra)),
                         lambda s, e: errors.append(e), async_save=True)
    state = _state()
    slices = [whole(name, t) for name, t in state.items()]
    blocking = writer.save(7, slices, {"engine": {"next_step": 7}})
    state["model/w"].add_(1.0)  # training goes on; the staged snapshot must not change
    blocking2 = writer.save(8, slices, {})  # waits for the first write: at most one in flight
    writer.flush()
    assert not errors and [r.step for r, _ in receipts] == [7, 8]
    assert writer.waited in (0, 1) and blocking >= 0 and blocking2 >= 0
    catalog.commit(job="j", step=7, generation=0, layout={}, spec_hash="h",
                   receipts=[receipts[0][0]], state=receipts[0][1])
    tensors, _ = load_checkpoint(catalog, 7)
    assert torch.equal(tensors["model/w"], _state()["model/w"])


def test_async_saves_share_one_low_priority_writer_thread_until_flush(catalog):
    seen, errors = [], []

    def on_receipt(receipt, extra):  # runs on the writer thread
        tid = threading.get_native_id()
        seen.append((receipt.step, threading.current_thread().name, tid, os.getpriority(os.PRIO_PROCESS, tid)))

    writer = ShardWriter(catalog.storage, 3, on_receipt, lambda s, e: errors.append(e), async_save=True)
    slices = [whole(name, t) for name, t in _state().items()]
    for step in (1, 2, 3):
        writer.save(step, slices, {})
        writer.wait()
    thread = writer._thread
    writer.flush()
    writer.save(4, slices, {})  # a save after flush starts a new thread
    writer.flush()
    assert not errors and [s for s, *_ in seen] == [1, 2, 3, 4]
    assert {name for _, name, _, _ in seen} == {"ckpt-writer-r3"}
    assert len({tid for _, _, tid, _ in seen[:3]}) == 1 and not thread.is_alive() and writer._thread is None
    if sys.platform.startswith("linux"):
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert all(nice == min(19, own + WRITER_NICE) for *_, nice in seen)


def test_a_failing_receipt_handler_is_reported_and_the_writer_goes_on(catalog):
    errors, receipts = [], []

    def on_receipt(receipt, extra):
        if receipt.step == 1:
            raise ConnectionError("controller store unreachable")
        receipts.append(receipt.step)

    writer = ShardWriter(catalog.storage, 0, on_receipt, lambda s, e: errors.append((s, e)), async_save=True)
    slices = [whole(name, t) for name, t in _state().items()]
    writer.save(1, slices, {})
    writer.save(2, slices, {})
    writer.flush()
    assert [(s, type(e).__name__) for s, e in errors] == [(1, "ConnectionError")] and receipts == [2]


def test_sync_writer_writes_the_live_tensors_byte_for_byte_as_the_async_one_and_stages_nothing(tmp_path):
    g = torch.Generator().manual_seed(5)
    state = {
        "model/wide": torch.randn(256, 1024, generator=g),  # 1 MiB: stored as 8 column tiles
        "model/wide_t": torch.randn(1024, 256, generator=g).t(),  # a strided source, also tiled
        "model/half": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
        "model/b": torch.randn(4, generator=g),
    }
    slices = [whole(name, t) for name, t in state.items()]
    shards, writers = {}, {}
    for mode in ("sync", "async"):
        storage = Storage(f"file://{tmp_path}/{mode}/job")
        receipts = []
        writers[mode] = ShardWriter(storage, 0, lambda r, extra, out=receipts: out.append(r), _raise,
                                    async_save=mode == "async")
        writers[mode].save(1, slices, {})
        writers[mode].flush()
        assert len(receipts[0].tensors["model/wide"].chunks) == 8
        shards[mode] = storage.read(storage.path(step_dir(1), receipts[0].file))
        Catalog(storage).commit(job="j", step=1, generation=0, layout={}, spec_hash="h", receipts=receipts, state={})
        loaded, _ = load_checkpoint(Catalog(storage), 1)
        assert all(torch.equal(loaded[name], t) for name, t in state.items())
    assert shards["sync"] == shards["async"]
    assert writers["sync"].staging.nbytes == 0  # a synchronous save holds no second copy of the state
    assert writers["async"].staging.nbytes == sum(t.numel() * t.element_size() for t in state.values())


def test_chunk_bytes_view_contiguous_host_tensors_and_gather_the_rest_into_one_buffer():
    as_bytes = _ChunkBytes()
    flat = torch.arange(12.0)
    view = as_bytes(flat)
    flat[0] = 99.0
    assert bytes(view[:4]) == torch.tensor([99.0]).numpy().tobytes()  # no copy was made
    grid = torch.arange(24.0).reshape(4, 6)
    first = bytes(as_bytes(grid[:, :3]))
    second = as_bytes(grid[:, 3:])
    assert first == grid[:, :3].contiguous().numpy().tobytes()
    assert bytes(second) == grid[:, 3:].contiguous().numpy().tobytes()
    assert as_bytes._scratch.numel() == 12 * 4  # one scratch buffer, reused for the second tile


def test_block_checksums_are_zlibs_crc32_whatever_computes_them():
    # The manifest promises zlib's CRC32: any reader (the standard library's included) can verify a block.
    data = torch.randint(0, 256, (3 * 4096 + 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw = data.numpy().tobytes()
    expected = [zlib.crc32(raw[start:start + 4096]) for start in range(0, len(raw), 4096)]
    assert block_crcs(data.numpy(), 4096) == expected and len(expected) == 4


def _raise(step: int, err: BaseException) -> None:
    raise err


def test_memory_filesystem_commit(tmp_path):
    cat = Catalog(Storage("memory://undying-test/job"))
    _save(cat, 3, _state())
    assert cat.latest() == 3
    with pytest.raises(AlreadyCommitted):
        cat.storage.create_exclusive(cat.manifest_path(3), b"{}")


# --- slices: who writes what, sharded round trips, partial verified reads, commit checks ---

BLOCK = 64  # small blocks, so that partial reads of small tensors are visible


def _global() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(8, 12, generator=g), "half": torch.randn(6, 5, generator=g).to(torch.bfloat16),
            "norm": torch.randn(12, generator=g), "step": torch.tensor(4.0),
            "mask": torch.rand(6, generator=g) > 0.5}


def _rank_slices(rank: int, tensors: dict[str, torch.Tensor]) -> list[TensorSlice]:
    """dp2 x tp2 (rank = 2 d + t): w rows by d and columns by t; half uneven by t, replicated over d;
    norm and step replicated over all four; mask split unevenly by rank."""
    d, t = divmod(rank, 2)

    def piece(name, offsets, lengths, replica=0, replicas=1):
        index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        src = tensors[name]
        return TensorSlice(name, src.dtype, tuple(src.shape), offsets, lengths, replica, replicas,
                           src[index].clone())

    return [piece("w", (d * 4, t * 6), (4, 6)), piece("half", (0, (0, 2)[t]), (6, (2, 3)[t]), d, 2),
            piece("norm", (0,), (12,), rank, 4), piece("step", (), (), rank, 4),
            piece("mask", ((0, 3, 4, 5)[rank],), ((3, 1, 1, 1)[rank],))]


def _save_sharded(catalog: Catalog, step: int, tensors: dict, world: int = 4) -> None:
    receipts = []
    for rank in range(world):
        held = _rank_slices(rank, tensors)
        receipts.append(write_slices(catalog.storage, step, rank, slices_to_write(held), 0.0, held=held,
                                     block_bytes=BLOCK))
    catalog.commit(job="j", step=step, generation=0, layout={"dp": 2, "tp": 2}, spec_hash="h",
                   receipts=receipts, state={"engine": {"next_step": step}})


def _wanted(name: str, tensors: dict, offsets: tuple, lengths: tuple) -> TensorSlice:
    t = tensors[name]
    return TensorSlice(name, t.dtype, tuple(t.shape), offsets, lengths)


def _as_replica(slices, replica, replicas):
    return [TensorSlice(s.name, s.dtype, s.global_shape, s.offsets, s.lengths, replica, replicas, s.tensor)
            for s in slices]


def test_large_replicated_slices_are_written_in_even_row_bands():
    t = torch.arange(42.0 * 8).reshape(42, 8)
    bands = [slices_to_write(_as_replica([whole("w", t)], r, 4), split_bytes=1024) for r in range(4)]
    assert [[(b.offsets, b.lengths) for b in band] for band in bands] == [
        [((0, 0), (10, 8))], [((10, 0), (11, 8))], [((21, 0), (10, 8))], [((31, 0), (11, 8))]]
    assert torch.equal(assemble([b for band in bands for b in band])["w"], t)
    small = [slices_to_write(_as_replica([whole("w", t)], r, 4), split_bytes=4096) for r in range(4)]
    assert [len(mine) for mine in small].count(1) == 1 and sum(map(len, small)) == 1  # one replica, whole


def test_small_replicated_slices_are_written_whole_once_spread_over_replicas():
    slices = [whole(f"t{i}", torch.zeros(i % 7 + 1)) for i in range(400)]
    written = [slices_to_write(_as_replica(slices, r, 4)) for r in range(4)]
    keys = [s.key for mine in written for s in mine]
    assert sorted(keys) == sorted(s.key for s in slices)  # each exactly once, whole
    counts = [len(mine) for mine in written]
    assert min(counts) > 70 and max(counts) < 130, counts  # 100 each on average


def test_each_slice_is_written_once_even_where_replica_groups_of_one_size_cross():
    # rank = 2 d + t holds a[t] replicated over d and b[d] replicated over t (both replicas=2),
    # as TP shards next to ZeRO-1 state of TP-replicated parameters with dp == tp. A greedy
    # balance over each rank's set would pick different writers for a[0] on ranks 0 and 2.
    def held(rank):
        d, t = divmod(rank, 2)
        a = [torch.zeros(25), torch.zeros(25)][t]
        b = [torch.zeros(75), torch.zeros(12)][d]
        return [TensorSlice("a", a.dtype, (50,), (t * 25,), (25,), d, 2, a),
                TensorSlice("b", b.dtype, (87,), ((0, 75)[d],), (len(b),), t, 2, b)]

    keys = [s.key for rank in range(4) for s in slices_to_write(held(rank))]
    assert sorted(keys) == sorted({s.key for rank in range(4) for s in held(rank)})


def test_every_slice_of_a_tp_dp_layout_is_written_by_exactly_one_rank():
    tensors = _global()
    keys = [s.key for rank in range(4) for s in slices_to_write(_rank_slices(rank, tensors))]
    assert len(keys) == len(set(keys))
    assert set(keys) == {s.key for rank in range(4) for s in _rank_slices(rank, tensors)}


@pytest.mark.parametrize("url", ["file", "memory"])
def test_sharded_save_loads_in_any_layout_reading_only_what_it_needs(tmp_path, url):
    from tests._counting_storage import CountingStorage

    root = f"file://{tmp_path}/job" if url == "file" else f"memory://undying-slices-{os.getpid()}/job"
    storage = CountingStorage(root)
    catalog, tensors = Catalog(storage), _global()
    _save_sharded(catalog, 5, tensors)
    whole_state, manifest = load_checkpoint(catalog, 5)
    for name, t in tensors.items():
        assert whole_state[name].dtype == t.dtype and torch.equal(whole_state[name], t), name
    assert manifest.state["engine"] == {"next_step": 5}
    total = sum(c.nbytes for e in manifest.tensors.values() for c in e.chunks)

    storage.reads.clear()
    wanted = [_wanted("w", tensors, (0, 9), (8, 3)), _wanted("half", tensors, (2, 0), (2, 5)),
              _wanted("step", tensors, (), ())]
    got = read_slices(catalog, 5, wanted, manifest=manifest, coalesce_gap=0)
    assert [s.key for s in got] == [w.key for w in wanted]
    for piece in got:
        assert torch.equal(piece.tensor, tensors[piece.name][piece.index()]), piece.name
    # w[:, 9:12]: columns 3..5 of the two 4x6 float32 chunks of tp rank 1 (96 bytes, two blocks each,
    # both touched); half[2:4]: one block of each of its two bf16 chunks (24 + 36 bytes); step: 4.
    assert storage.bytes_read == 2 * 96 + 24 + 36 + 4 < total
    storage.reads.clear()
    read_slices(catalog, 5, wanted, manifest=manifest)  # close ranges of a file merge into one request
    assert len(storage.reads) == len({f for f, _, _ in storage.reads}) < 5
    storage.reads.clear()
    read_slices(catalog, 5, [_wanted("w", tensors, (0, 0), (4, 6))], manifest=manifest)
    chunk = next(c for c in manifest.tensors["w"].chunks if c.offsets == [0, 0])
    assert storage.reads == [(chunk.file, chunk.byte_offset, chunk.byte_offset + 96)]  # exactly one chunk


def test_partial_reads_verify_only_their_blocks_and_a_bad_one_is_corrupt(catalog):
    tensors = _global()
    _save_sharded(catalog, 5, tensors)
    manifest = catalog.read_manifest(5)
    chunk = next(c for c in manifest.tensors["w"].chunks if c.offsets == [0, 0])
    assert chunk.nbytes == 96 and len(chunk.block_crc32) == 2
    shard = os.path.join(catalog.storage.root, step_dir(5), chunk.file)
    with open(shard, "r+b") as f:  # flip a byte of w's first chunk, second block (rows 2..3)
        f.seek(chunk.byte_offset + 80)
        byte = f.read(1)
        f.seek(chunk.byte_offset + 80)
        f.write(bytes([byte[0] ^ 0x01]))
    top = read_slices(catalog, 5, [_wanted("w", tensors, (0, 0), (1, 6))])  # row 0: first block only
    assert torch.equal(top[0].tensor, tensors["w"][:1, :6])
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch in shard-r00000.bin"):
        read_slices(catalog, 5, [_wanted("w", tensors, (3, 0), (1, 6))])
    with pytest.raises(CorruptCheckpoint):
        verify_checkpoint(catalog, 5)


def test_truncated_shard_is_corrupt(catalog):
    _save_sharded(catalog, 5, _global())
    shard = os.path.join(catalog.storage.root, step_dir(5), "shard-r00003.bin")
    os.truncate(shard, os.path.getsize(shard) - 10)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        load_checkpoint(catalog, 5)


def test_reading_a_tensor_the_checkpoint_lacks_is_a_layout_error_not_corruption(catalog):
    tensors = _global()
    _save_sharded(catalog, 5, tensors)
    with pytest.raises(ValueError, match="other: the checkpoint has no such tensor") as info:
        read_slices(catalog, 5, [TensorSlice("other", torch.float32, (2,), (0,), (2,))])
    assert not isinstance(info.value, CorruptCheckpoint)


def _receipts(catalog: Catalog, step: int, per_rank: list[list[TensorSlice]], held=None):
    return [write_slices(catalog.storage, step, rank, written, 0.0, held=(held or [[]] * len(per_rank))[rank],
                         block_bytes=BLOCK) for rank, written in enumerate(per_rank)]


def test_commit_refuses_shards_that_do_not_tile_every_tensor(catalog):
    t = torch.arange(24.0).reshape(4, 6)

    def rows(a, b):
        return TensorSlice("t", t.dtype, (4, 6), (a, 0), (b - a, 6), tensor=t[a:b].clone())

    cases = {
        "written twice": [[rows(0, 2)], [rows(0, 2)], [rows(2, 4)]],
        "overlapping": [[rows(0, 3)], [rows(2, 4)]],
        r"the chunks cover 12 of 24 elements \(element \(2, 0\) is missing\)": [[rows(0, 2)], []],
    }
    for step, (message, per_rank) in enumerate(cases.items(), start=1):
        receipts = _receipts(catalog, step, per_rank)
        with pytest.raises(IncompleteCheckpoint, match=f"t: {message}"):
            catalog.commit(job="j", step=step, generation=0, layout={}, spec_hash="h", receipts=receipts, state={})
    # A tensor every rank holds but no rank wrote (replicas that disagree on the assignment).
    held = [whole("norm", torch.ones(3), r, 2) for r in range(2)]
    receipts = _receipts(catalog, 9, [[], []], held=[[held[0]], [held[1]]])
    with pytest.raises(IncompleteCheckpoint, match="norm: the chunks cover 0 of 3 elements"):
        catalog.commit(job="j", step=9, generation=0, layout={}, spec_hash="h", receipts=receipts, state={})
    mixed = _receipts(catalog, 10, [[rows(0, 4)], [whole("t", torch.zeros(4, 6, dtype=torch.float64))]])
    with pytest.raises(IncompleteCheckpoint, match="as float64"):
        catalog.commit(job="j", step=10, generation=0, layout={}, spec_hash="h", receipts=mixed, state={})
    assert catalog.committed_steps() == []


def test_committer_drops_an_incomplete_save_loudly(catalog, caplog):
    t = torch.arange(6.0)
    half = TensorSlice("t", t.dtype, (6,), (0,), (3,), tensor=t[:3].clone())
    receipts = _receipts(catalog, 4, [[half], [half]])
    committer = Committer(catalog, "j", "h", keep=2)
    extras = [{"engine": {"next_step": 4}} if r.rank == 0 else {} for r in receipts]
    with caplog.at_level(logging.ERROR, logger="ckpt.commit"):
        assert committer.on_receipt(receipts[0], extras[0], 2, 0, {}, lambda samples: {}) is None
        assert committer.on_receipt(receipts[1], extras[1], 2, 0, {}, lambda samples: {}) is None
    assert "written twice" in committer.rejected[4] and "step 4 NOT committed" in caplog.text
    assert committer.latest is None and not committer.pending and catalog.committed_steps() == []


def test_a_job_resumed_behind_the_newest_commit_keeps_its_saves_in_progress(catalog):
    # Step 30 is committed but this run skipped it (a rank could not read it) and resumed from 10.
    # Its save of 20 commits while its save of 25 is still being written (no receipt yet): 25 is
    # older than the newest commit and has no manifest, yet it is this run's save, not garbage.
    for step in (10, 30):
        _save(catalog, step, _state(step))
    committer = Committer(catalog, "j", "h", keep=3)
    committer.reset(10)
    twenty = shard_receipts(catalog, 20, _state(20))
    in_progress = shard_receipts(catalog, 25, _state(25))
    assert feed(committer, twenty).step == 20
    assert catalog.all_steps() == [10, 20, 25, 30] and catalog.committed_steps() == [10, 20, 30]
    assert feed(committer, in_progress).step == 25
    load_checkpoint(catalog, 25)
    # Once the run commits past the stale save, that one is garbage like any other.
    write_shard(catalog.storage, 27, 0, _state(27), blocking_s=0.0)
    committer.reset(30)
    assert feed(committer, shard_receipts(catalog, 40, _state(40))).step == 40
    assert 27 not in catalog.all_steps()


def test_a_manifest_is_never_committed_over_a_missing_shard_file(catalog, caplog):
    receipts = shard_receipts(catalog, 20, _state(20), world=3)
    os.remove(os.path.join(catalog.storage.root, step_dir(20), receipts[1].file))
    committer = Committer(catalog, "j", "h", keep=2)
    with caplog.at_level(logging.ERROR, logger="ckpt.commit"):
        assert feed(committer, receipts) is None
    assert f"{receipts[1].file}" in committer.rejected[20] and "not in storage" in committer.rejected[20]
    assert catalog.committed_steps() == [] and "step 20 NOT committed" in caplog.text


def test_reads_run_in_parallel_threads(tmp_path):
    from tests._counting_storage import CountingStorage

    threads = set()

    class Recording(CountingStorage):
        def read_range_into(self, path, start, out):
            threads.add(threading.current_thread().name)
            return super().read_range_into(path, start, out)

    catalog = Catalog(Recording(f"file://{tmp_path}/job"))
    _save_sharded(catalog, 5, _global())
    load_checkpoint(catalog, 5)
    assert len(catalog.storage.reads) == 4 and all(name.startswith("ckpt-read") for name in threads)


def test_engine_state_round_trips_through_the_rank_glue(tmp_path):
    from orchestrator.rank.state import load_engine_state
    from tests._checkpoints import commit_trained_engine, tiny_engine

    spec, source = commit_trained_engine(f"file://{tmp_path}/job")
    restored = tiny_engine()
    assert load_engine_state(spec, restored, 2)["engine"]["next_step"] == 2
    saved = {s.key: s.tensor for s in source.state_slices()}
    assert saved and {s.key: s.tensor for s in restored.state_slices()}.keys() == saved.keys()
    for piece in restored.state_slices():
        assert torch.equal(piece.tensor, saved[piece.key]), piece.name
    assert restored.train_step().loss == source.train_step().loss
