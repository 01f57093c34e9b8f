"""Rank side of a save: which slices this rank writes, and the shard file format.

Protocol: at a checkpoint step every rank (through `ckpt.writer.ShardWriter`) calls
`slices_to_write(slices)` on the `TensorSlice`s its engine holds (pure, a function of each
slice alone, so every replica agrees without communication), stages them (or not, for a
synchronous save) and calls `write_slices(...)`, which cuts them into the chunks of the file in
file order (`file_order`) and writes one immutable shard file, returning a `ShardReceipt` for
the controller.
The controller commits the manifest once every rank's receipt is in and their chunks tile
every tensor (`ckpt.manifest.merge_receipts`).

A shard file is raw row-major bytes of its chunks back to back, each chunk starting at an
`ALIGN`-byte boundary (zero padding between), never pickle. Offsets, lengths and per-block
CRC32s live in the receipt and then in the manifest. A wide slice is stored as several
chunks, its column tiles (`column_tiles`), so that column-split loads read contiguous bytes.
"""

from __future__ import annotations

import heapq
import time
import zlib
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from ckpt.blocks import ALIGN, BLOCK_BYTES, block_crcs, check_block_bytes
from ckpt.manifest import Chunk, ShardReceipt, TensorEntry, step_dir
from ckpt.storage import Storage
from trainer.state_slices import TensorSlice, whole

SPLIT_BYTES = 4 * BLOCK_BYTES  # replicated slices at least this large are written in row bands by all replicas
# Wide chunks are stored as this many column tiles (see `column_tiles`): loads that split
# columns 2, 4 or 8 ways then read only their own tiles.
COLUMN_TILES = 8
MIN_TILE_BYTES = 64 << 10  # smaller tiles would turn a same-layout load into many small reads
# A chunk is handed to the store in pieces of at most this many bytes, each reported to `on_progress`:
# the controller tells a long save from a hang by these bytes moving (orchestrator.controller.telemetry).
PROGRESS_BYTES = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


def _greedy(sizes: Sequence[tuple[Hashable, int]], bins: int) -> dict[Hashable, int]:
    """Largest first onto the least-loaded bin; ties broken by key order and bin index."""
    load = [(0, b) for b in range(bins)]
    out = {}
    for key, size in sorted(sizes, key=lambda item: (-item[1], item[0])):
        used, target = heapq.heappop(load)
        out[key] = target
        heapq.heappush(load, (used + size, target))
    return out


def owned_by(rank: int, world_size: int, sizes: dict[str, int]) -> set[str]:
    """Names of tensors replicated on all `world_size` ranks that `rank` writes: each once, bytes spread evenly.

    Needs every rank to pass the same `sizes` (whole-tensor DDP state); `slices_to_write`
    is the general rule for slices.
    """
    return {name for name, owner in _greedy(list(sizes.items()), world_size).items() if owner == rank}


def slices_to_write(slices: Iterable[TensorSlice], split_bytes: int = SPLIT_BYTES) -> list[TensorSlice]:
    """This rank's share of its slices: every element of a replicated slice is written by exactly one replica.

    Each decision depends on the slice alone (its geometry and `replicas`), never on the
    rest of the rank's slice set: two replica groups of the same size can cross at a rank
    (ZeRO-1 optimizer state replicated over tp next to TP shards replicated over dp, with
    dp == tp), so a set-wide greedy assignment could differ between the holders of a slice
    and leave it unwritten or written twice.
      * Large slices (>= `split_bytes`, at least `replicas` rows) are cut into `replicas`
        row bands of near-equal size; replica r writes band r. The bytes that dominate a
        checkpoint are so spread exactly evenly.
      * Smaller ones are written whole by the replica a stable hash of their geometry picks,
        which spreads many small slices evenly on average.
    Unreplicated slices (replicas == 1) are written as they are.
    """
    mine = []
    for piece in slices:
        if piece.replicas == 1:
            mine.append(piece)
        elif piece.nbytes >= split_bytes and piece.lengths and piece.lengths[0] >= piece.replicas:
            mine.append(_band(piece, piece.replica, piece.replicas))
        elif zlib.crc32(repr(piece.key).encode()) % piece.replicas == piece.replica:
            mine.append(piece)
    return sorted(mine, key=lambda piece: piece.key)


def _band(piece: TensorSlice, index: int, count: int) -> TensorSlice:
    """Rows [index * n / count, (index + 1) * n / count) of the slice, as a slice of the logical tensor."""
    rows = piece.lengths[0]
    lo, hi = index * rows // count, (index + 1) * rows // count
    tensor = piece.tensor[lo:hi] if piece.tensor is not None else None
    return TensorSlice(piece.name, piece.dtype, piece.global_shape, (piece.offsets[0] + lo, *piece.offsets[1:]),
                       (hi - lo, *piece.lengths[1:]), tensor=tensor)


def column_tiles(piece: TensorSlice, tiles: int = COLUMN_TILES, min_tile_bytes: int = MIN_TILE_BYTES,
                 ) -> list[TensorSlice]:
    """`piece` cut along its last dimension into `tiles` near-equal column bands, each stored as a chunk.

    Row-major bytes put a column slice's elements in every row of a chunk, so a load that
    splits columns (a tp4 layout reading a checkpoint whose weights were split by rows)
    would fetch, and checksum, every block of every chunk: 4x the bytes for tp4. Stored as
    column tiles, each tile is contiguous and such a load reads only its tiles; a load of
    whole rows reads all tiles, which lie back to back and are fetched as one range. The
    manifest needs nothing new: tiles are ordinary rectangular chunks. Only chunks with at
    least two dimensions, `tiles` columns and `tiles * min_tile_bytes` bytes are cut.
    """
    if len(piece.lengths) < 2 or piece.lengths[-1] < tiles or piece.nbytes < tiles * min_tile_bytes:
        return [piece]
    if piece.tensor is None:
        raise ValueError(f"{piece.name}{list(piece.offsets)}: a slice to write has no data")
    cols, out = piece.lengths[-1], []
    for index in range(tiles):
        lo, hi = index * cols // tiles, (index + 1) * cols // tiles
        offsets = (*piece.offsets[:-1], piece.offsets[-1] + lo)
        out.append(TensorSlice(piece.name, piece.dtype, piece.global_shape, offsets, (*piece.lengths[:-1], hi - lo),
                               tensor=piece.tensor[..., lo:hi]))
    return out


def file_order(written: Iterable[TensorSlice], min_tile_bytes: int = MIN_TILE_BYTES) -> list[TensorSlice]:
    """The chunks of a shard file in the order they are written: untiled slices, then tile 0 of
    every tiled slice, tile 1 of every tiled slice, and so on (each group by slice key).

    Tile-major order makes every column band of the file contiguous: a load that splits
    columns k ways (k dividing `COLUMN_TILES`) wants tiles [i*8/k, (i+1)*8/k) of every chunk,
    which lie back to back here, so it reads one range per file where a chunk-major order
    would need one per chunk with unneeded tiles between them. A load of whole rows reads the
    whole file either way. The order is free to choose: chunks carry their byte offsets.
    """
    ordered = []
    for piece in written:
        tiles = column_tiles(piece, min_tile_bytes=min_tile_bytes)
        for index, tile in enumerate(tiles):
            ordered.append(((index if len(tiles) > 1 else -1, piece.key), tile))
    return [tile for _, tile in sorted(ordered, key=lambda item: item[0])]


def shard_file_name(rank: int, tag: str = "") -> str:
    """The shard file of `rank`; `tag` names the save attempt (controller run and generation).

    With a tag, a second attempt at the same step (after falling back from a corrupt
    checkpoint, or by a second controller on the same job) writes new files instead of
    overwriting the shards some committed manifest may name."""
    return f"shard-{tag}-r{rank:05d}.bin" if tag else f"shard-r{rank:05d}.bin"


class _ChunkBytes:
    """Row-major bytes of each chunk to write, copying only what is not already contiguous host memory.

    A contiguous CPU chunk (an untiled staged slice) is handed out as a view of its own memory.
    A column tile (a strided view, of a staged or a live tensor) or a device tensor is gathered into one
    scratch buffer, kept and grown for the whole file: the bytes of one chunk are checksummed
    and handed to the file's `write` (which copies them into its direct-I/O buffer, the page
    cache or the upload buffer) before the next chunk reuses it. A fresh contiguous copy per tile would fault in
    new pages for every byte of the state, which costs more than the copy itself.
    """

    def __init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def __call__(self, tensor: torch.Tensor) -> memoryview:
        tensor = tensor.detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            nbytes = tensor.numel() * tensor.element_size()
            if self._scratch.numel() < nbytes:
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            tensor = self._scratch[:nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_slices(
    storage: Storage, step: int, rank: int, written: Sequence[TensorSlice], blocking_s: float,
    held: Iterable[TensorSlice] = (), block_bytes: int = BLOCK_BYTES, tag: str = "",
    min_tile_bytes: int = MIN_TILE_BYTES, on_progress: Callable[[int], None] | None = None,
) -> ShardReceipt:
    """Write the `written` slices (with data) as this rank's immutable shard file for `step`.

    `held`: every slice the rank holds, written or not; their tensors are named in the
    receipt (without chunks) so the commit can check that somebody wrote them. Wide slices
    are stored as column tiles (`column_tiles`, at least `min_tile_bytes` each).
    `on_progress(nbytes)` is called after each piece of data (at most PROGRESS_BYTES) the
    store took, from the calling thread.

    Contiguous host chunks are written from their own memory; column tiles are gathered into
    one reused scratch buffer (`_ChunkBytes`).
    """
    started = time.perf_counter()
    check_block_bytes(block_bytes)
    file = shard_file_name(rank, tag)
    entries: dict[str, TensorEntry] = {}
    chunks = file_order(written, min_tile_bytes)
    for piece in [*held, *chunks]:
        entries.setdefault(piece.name, TensorEntry(dtype=dtype_name(piece.dtype), shape=list(piece.global_shape)))
    offset, as_bytes = 0, _ChunkBytes()
    # Streamed: the staged tensors are the only copy of the state this rank holds in memory.
    with storage.atomic_writer(storage.path(step_dir(step), file)) as out:
        for piece in chunks:
            if piece.tensor is None:
                raise ValueError(f"{piece.name}{list(piece.offsets)}: a slice to write has no data")
            data = as_bytes(piece.tensor)
            pad = -offset % ALIGN
            out.write(bytes(pad))
            offset += pad
            entries[piece.name].chunks.append(Chunk(
                offsets=list(piece.offsets), lengths=list(piece.lengths), file=file, byte_offset=offset,
                nbytes=len(data), block_bytes=block_bytes, block_crc32=block_crcs(data, block_bytes),
            ))
            _write_in_pieces(out, data, on_progress)
            offset += len(data)
    return ShardReceipt(
        step=step, rank=rank, file=file, nbytes=offset, tensors=entries,
        blocking_s=blocking_s, write_s=time.perf_counter() - started,
    )


def _write_in_pieces(out, data, on_progress: Callable[[int], None] | None) -> None:
    if on_progress is None:
        out.write(data)
        return
    view = memoryview(data).cast("B")
    for start in range(0, len(view), PROGRESS_BYTES):
        piece = view[start:start + PROGRESS_BYTES]
        out.write(piece)
        on_progress(len(piece))


def write_shard(
    storage: Storage, step: int, rank: int, tensors: dict[str, torch.Tensor], blocking_s: float,
    block_bytes: int = BLOCK_BYTES,
) -> ShardReceipt:
    """Write whole, unreplicated tensors as this rank's shard (tools and tests with no engine)."""
    pieces = [whole(name, t) for name, t in tensors.items()]
    return write_slices(storage, step, rank, pieces, blocking_s, block_bytes=block_bytes)
