"""The load path's byte economy: column tiles on save, reads straight into tensors, views instead of copies."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.fetch import fetch
from ckpt.manifest import step_dir
from ckpt.reader import CorruptCheckpoint, load_checkpoint, read_slices
from ckpt.reshard import plan_reads
from ckpt.shards import column_tiles, write_slices
from ckpt.storage import Storage
from tests._counting_storage import CountingStorage
from trainer.state_slices import TensorSlice, whole

ROWS, COLS = 64, 256  # float32: 64 KiB, eight 8 KiB column tiles at MIN_TILE = 1 KiB
MIN_TILE = 1024
BLOCK = 1024


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"model/wide": torch.randn(ROWS, COLS, generator=g), "model/small": torch.randn(4, 16, generator=g),
            "model/bias": torch.randn(COLS, generator=g), "model/half": torch.randn(32, 64, generator=g).bfloat16()}


def _save(storage: Storage, tensors: dict[str, torch.Tensor]):
    receipt = write_slices(storage, 1, 0, [whole(n, t) for n, t in tensors.items()], 0.0, block_bytes=BLOCK,
                           min_tile_bytes=MIN_TILE)
    return Catalog(storage).commit(job="j", step=1, generation=0, layout={}, spec_hash="h", receipts=[receipt],
                                   state={})


def _cols(name: str, t: torch.Tensor, lo: int, hi: int) -> TensorSlice:
    return TensorSlice(name, t.dtype, tuple(t.shape), (0, lo), (t.shape[0], hi - lo))


def test_column_tiles_cut_only_wide_two_dimensional_slices():
    wide = whole("w", torch.randn(ROWS, 20))
    tiles = column_tiles(wide, tiles=8, min_tile_bytes=16)
    assert [t.offsets for t in tiles] == [(0, c) for c in (0, 2, 5, 7, 10, 12, 15, 17)]  # uneven: 2 or 3 wide
    assert sum(t.lengths[1] for t in tiles) == 20 and all(t.lengths[0] == ROWS for t in tiles)
    assert all(torch.equal(t.tensor, wide.tensor[:, t.offsets[1]:t.offsets[1] + t.lengths[1]]) for t in tiles)
    for piece in (whole("b", torch.randn(4096)), whole("narrow", torch.randn(64, 7)), whole("w", torch.randn(8, 8))):
        assert len(column_tiles(piece, tiles=8, min_tile_bytes=1024)) == 1, piece.name


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/job"
        return
    root = f"undying-tiles-{uuid.uuid4().hex}"
    yield f"memory://{root}/job"
    fsspec.filesystem("memory").rm(f"/{root}", recursive=True)


def test_column_split_load_reads_only_its_tiles_and_row_load_all_in_one_range(url):
    storage, tensors = CountingStorage(url), _tensors()
    manifest = _save(storage, tensors)
    assert len(manifest.tensors["model/wide"].chunks) == 8  # 64 KiB >= 8 x 1 KiB
    assert len(manifest.tensors["model/small"].chunks) == 1 and len(manifest.tensors["model/bias"].chunks) == 1
    catalog = Catalog(storage)

    wide = tensors["model/wide"]
    got = read_slices(catalog, 1, [_cols("model/wide", wide, 64, 128)], coalesce_gap=0)  # a tp4 rank's quarter
    assert torch.equal(got[0].tensor, wide[:, 64:128])
    assert storage.bytes_read == ROWS * 64 * 4  # its two tiles, nothing else: no read amplification
    assert len(storage.reads) == 1  # adjacent tiles: one range

    storage.reads.clear()
    whole_state, _ = load_checkpoint(catalog, 1)
    for name, t in tensors.items():
        assert whole_state[name].dtype == t.dtype and torch.equal(whole_state[name], t), name
    assert len(storage.reads) == 1  # tiles and tensors lie back to back: one request for the file

    storage.reads.clear()
    rows = TensorSlice("model/wide", wide.dtype, (ROWS, COLS), (0, 0), (ROWS // 2, COLS))
    got = read_slices(catalog, 1, [rows], coalesce_gap=0)
    assert torch.equal(got[0].tensor, wide[: ROWS // 2])
    assert storage.bytes_read == ROWS // 2 * COLS * 4  # the upper half of each tile, blocks of 1 KiB


def test_a_column_band_of_every_wide_tensor_is_one_range_of_the_file(url):
    # Tile-major file order: a tp4 rank's quarter of every wide chunk lies back to back.
    storage = CountingStorage(url)
    g = torch.Generator().manual_seed(6)
    tensors = {f"model/w{i}": torch.randn(ROWS, COLS, generator=g) for i in range(3)}
    tensors["model/bias"] = torch.randn(COLS, generator=g)
    _save(storage, tensors)
    wanted = [_cols(f"model/w{i}", tensors[f"model/w{i}"], 128, 192) for i in range(3)]
    got = read_slices(Catalog(storage), 1, wanted, coalesce_gap=0)
    for piece in got:
        assert torch.equal(piece.tensor, tensors[piece.name][:, 128:192]), piece.name
    assert storage.bytes_read == 3 * ROWS * 64 * 4 and len(storage.reads) == 1


def test_same_layout_load_views_the_fetched_bytes_and_stays_exact(tmp_path):
    tensors = {"model/a": torch.randn(8, 4), "model/b": torch.randn(16).bfloat16(), "optim/step": torch.tensor(3.0)}
    catalog = Catalog(Storage(f"file://{tmp_path}/job"))
    _save(catalog.storage, tensors)
    got = {p.name: p.tensor for p in read_slices(catalog, 1, [whole(n, t).with_tensor(None)
                                                              for n, t in tensors.items()])}
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # one range fetched for the file, every tensor a view of it: no second copy
    assert got["model/a"].untyped_storage().data_ptr() == got["model/b"].untyped_storage().data_ptr()
    got["model/a"].add_(1.0)  # writable, and no other slice shares its elements
    assert torch.equal(got["model/b"], tensors["model/b"]) and torch.equal(got["optim/step"], tensors["optim/step"])
    # a wanted dtype that differs from the stored one gets a fresh, cast tensor
    cast = read_slices(catalog, 1, [TensorSlice("model/b", torch.float32, (16,), (0,), (16,))])[0].tensor
    assert cast.dtype == torch.float32 and torch.equal(cast, tensors["model/b"].float())


def test_a_short_file_read_into_the_buffer_is_caught(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/job"))
    manifest = _save(catalog.storage, {"model/a": torch.randn(300)})
    shard = catalog.storage.path(step_dir(1), manifest.tensors["model/a"].chunks[0].file)
    with open(shard, "r+b") as f:
        f.truncate(700)
    with pytest.raises(CorruptCheckpoint, match="truncated: got 700 of the 1200 bytes"):
        load_checkpoint(catalog, 1)


def test_a_long_range_is_fetched_in_concurrent_pieces_into_one_buffer_and_verified(url):
    storage, tensors = CountingStorage(url), _tensors()
    manifest = _save(storage, tensors)
    wanted = [whole(n, t).with_tensor(None) for n, t in tensors.items()]
    plan = plan_reads(manifest.tensors, wanted)
    assert len(plan.reads) == 1  # the whole file, one range
    size = plan.reads[0].end - plan.reads[0].start
    fetched = fetch(storage, 1, plan.reads, piece_bytes=3000)  # not a multiple of anything stored
    (start, data), = fetched[plan.reads[0].file]
    assert len(data) == size and sorted(storage.reads) == [
        (plan.reads[0].file, lo, min(lo + 3000, size)) for lo in range(0, size, 3000)]
    storage.reads.clear()
    whole_bytes = fetch(storage, 1, plan.reads)[plan.reads[0].file][0][1]
    assert len(storage.reads) == 1 and torch.equal(data, whole_bytes)

    # A bit flipped in a middle piece is caught once the range is complete, whoever read it.
    shard = storage.path(step_dir(1), plan.reads[0].file)
    raw = bytearray(storage.read(shard))
    raw[size // 2] ^= 0x10
    storage.fs.pipe_file(shard, bytes(raw))
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        fetch(storage, 1, plan.reads, piece_bytes=3000)
    storage.fs.pipe_file(shard, bytes(raw[: size - 5000]))
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        fetch(storage, 1, plan.reads, piece_bytes=3000)
    assert fetch(storage, 1, plan.reads[:0], piece_bytes=3000) == {}


def test_wanted_tensors_are_filled_in_place_and_left_untouched_by_a_corrupt_checkpoint(url):
    storage, tensors = CountingStorage(url), _tensors()
    _save(storage, tensors)
    catalog = Catalog(storage)
    wide, half = tensors["model/wide"], tensors["model/half"]
    targets = [_cols("model/wide", wide, 64, 160).with_tensor(torch.full((ROWS, 96), -1.0)),
               whole("model/half", half).with_tensor(torch.zeros_like(half)),
               whole("model/bias", tensors["model/bias"]).with_tensor(None)]
    got = read_slices(catalog, 1, targets)
    assert got[0].tensor is targets[0].tensor and torch.equal(got[0].tensor, wide[:, 64:160])
    assert got[1].tensor is targets[1].tensor and torch.equal(got[1].tensor, half)  # same layout: filled, not viewed
    assert torch.equal(got[2].tensor, tensors["model/bias"])

    with pytest.raises(ValueError, match="the tensor to fill is torch.float32, the slice says torch.bfloat16"):
        read_slices(catalog, 1, [whole("model/half", half).with_tensor(torch.zeros(half.shape))])

    tile = next(c for c in catalog.read_manifest(1).tensors["model/wide"].chunks if c.offsets == [0, 128])
    shard = storage.path(step_dir(1), tile.file)
    raw = bytearray(storage.read(shard))
    raw[tile.byte_offset + tile.nbytes // 2] ^= 0x01  # in a tile the column band 64..160 needs
    storage.fs.pipe_file(shard, bytes(raw))
    fresh = torch.full((ROWS, 96), -1.0)
    with pytest.raises(CorruptCheckpoint):
        read_slices(catalog, 1, [_cols("model/wide", wide, 64, 160).with_tensor(fresh),
                                 whole("model/half", half).with_tensor(torch.zeros_like(half))])
    assert torch.equal(fresh, torch.full((ROWS, 96), -1.0))  # nothing written before every block verified
