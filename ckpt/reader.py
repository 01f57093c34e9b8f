"""Read a committed checkpoint back into any layout: plan, fetch byte ranges, verify, assemble.

Protocol: a restoring rank calls `read_slices(catalog, step, engine.wanted_slices())` and
passes the result to `engine.load_slices(slices, manifest.state["engine"])`. The rank reads
only the blocks its slices need (ckpt.reshard plans them from the manifest alone; no
collectives, no other rank involved), verifies each block's CRC32, and copies the stored
regions into its target slices, whatever layout wrote them. `load_checkpoint` does the
same with whole tensors as targets (one process, tools, tests).

A missing shard, a bad checksum or a manifest whose chunks leave a slice unstored raises
`CorruptCheckpoint`; the controller then marks that step bad and restores the previous
committed one, loudly (log line and metric), never silently. A store that fails reads
transiently (timeouts, 5xx, throttling) is retried for a bounded time (`retry`,
ckpt.storage_errors.ReadRetry) and then raises `TransientStorageError`, which is no proof
of corruption: the controller fails the job instead of falling back. `newest_loadable` performs
the same walk for tools that verify whole checkpoints offline. A manifest of another
schema version raises `UnsupportedManifest` (not retried with older checkpoints).
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from ckpt.boxes import row_major_strides
from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint, TransientStorageError, UnsupportedManifest, corrupt_at
from ckpt.fetch import READ_THREADS, fetch
from ckpt.manifest import MANIFEST_NAME, Manifest
from ckpt.reshard import COALESCE_GAP, Copy, CoverageError, RangeRead, ReadPlan, plan_reads
from ckpt.shards import dtype_from_name, itemsize
from ckpt.storage_errors import CORRUPT, ReadRetry, classify
from trainer.state_slices import TensorSlice

__all__ = ["CorruptCheckpoint", "TransientStorageError", "UnsupportedManifest", "assemble", "load_checkpoint",
           "newest_loadable", "read_manifest", "read_slices", "verify_checkpoint"]

log = logging.getLogger(__name__)


def read_manifest(catalog: Catalog, step: int, retry: ReadRetry | None = None) -> Manifest:
    """The committed manifest of `step`; CorruptCheckpoint when it is absent or unreadable,
    TransientStorageError when the store failed the read for the whole `retry` budget."""
    retry = retry if retry is not None else ReadRetry()
    try:
        return retry.call(lambda: catalog.read_manifest(step), f"step {step}: reading the manifest")
    except CorruptCheckpoint as err:  # parse_manifest's proof: located at the manifest, which is cheap to check
        err.location = err.location or (MANIFEST_NAME, 0, 0)
        raise
    except TransientStorageError:  # the retry gave up
        raise
    except Exception as err:
        if classify(err) == CORRUPT:
            raise corrupt_at(f"step {step} has no committed manifest", MANIFEST_NAME, 0, 0) from err
        raise


def read_slices(
    catalog: Catalog, step: int, wanted: Sequence[TensorSlice], *,
    manifest: Manifest | None = None, threads: int = READ_THREADS, coalesce_gap: int = COALESCE_GAP,
    retry: ReadRetry | None = None, on_bytes=None,
) -> list[TensorSlice]:
    """`wanted` (geometry only) filled from committed checkpoint `step`, in the same order.

    A wanted slice that carries a tensor (of its dtype, on any device) is filled in place:
    every element is overwritten, and only after every needed block has been fetched and
    verified, so a corrupt checkpoint leaves it untouched; the restorer so needs no second
    copy of its state. The others get a CPU tensor of the wanted dtype (stored values are cast
    if the dtypes differ), either fresh or a view of the fetched bytes; slices never share
    elements, and the tensors are writable. Needed ranges of a file less than `coalesce_gap` bytes apart
    are fetched as one request. Raises ValueError when a wanted tensor is not in the
    checkpoint or has another global shape, CorruptCheckpoint when the bytes are bad,
    TransientStorageError when the store's failures took the whole `retry` budget (one for
    the manifest and all the pieces: ckpt.storage_errors.ReadRetry). `on_bytes(n, total)`
    follows the reads (ckpt.fetch.fetch).
    """
    for w in wanted:
        if w.tensor is not None and w.tensor.dtype != w.dtype:
            raise ValueError(f"{w.name}{list(w.offsets)}: the tensor to fill is {w.tensor.dtype}, the slice says "
                             f"{w.dtype}; pass a tensor of the slice's dtype or none")
    retry = retry if retry is not None else ReadRetry()  # one budget for the manifest and every piece
    manifest = manifest if manifest is not None else read_manifest(catalog, step, retry)
    plan = _plan(manifest, step, wanted, coalesce_gap)
    return assemble(wanted, plan, fetch(catalog.storage, step, plan.reads, threads=threads, retry=retry,
                                        on_bytes=on_bytes))


def assemble(wanted: Sequence[TensorSlice], plan: ReadPlan, fetched: dict) -> list[TensorSlice]:
    """`wanted` filled from the fetched bytes of `plan` (see `read_slices` for the in-place rule)."""
    starts = {file: [start for start, _ in ranges] for file, ranges in fetched.items()}
    sources: dict[int, list[Copy]] = defaultdict(list)
    for copy in plan.copies:
        sources[copy.target].append(copy)
    out = []
    for index, w in enumerate(wanted):
        copies = sources[index]
        if w.tensor is None and len(copies) == 1 and dtype_from_name(copies[0].dtype) == w.dtype:
            # The slice is one region of one stored chunk (a same-layout load): when that
            # region is contiguous, the fetched bytes are the tensor, and nothing is copied.
            region = _source(fetched[copies[0].file], starts[copies[0].file], copies[0])
            if region.is_contiguous():
                out.append(region)
                continue
        tensor = w.tensor if w.tensor is not None else torch.empty(w.lengths, dtype=w.dtype)
        for copy in copies:
            dst = tuple(slice(o, o + n) for o, n in zip(copy.dst_offsets, copy.lengths, strict=True))
            tensor[dst] = _source(fetched[copy.file], starts[copy.file], copy)
        out.append(tensor)
    return [w.with_tensor(t) for w, t in zip(wanted, out, strict=True)]


def load_checkpoint(
    catalog: Catalog, step: int, names: Iterable[str] | None = None, manifest: Manifest | None = None
) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Whole tensors `names` (all when None) of committed checkpoint `step`, verified, plus its manifest
    (`manifest`: the one read already, by a caller reading the step in several batches)."""
    manifest = manifest or read_manifest(catalog, step)
    names = list(manifest.tensors) if names is None else list(names)
    missing = [n for n in names if n not in manifest.tensors]
    if missing:
        raise KeyError(f"checkpoint step {step} has no tensors {missing[:5]}")
    slices = read_slices(catalog, step, _whole_targets(manifest, names), manifest=manifest)
    return {piece.name: piece.tensor for piece in slices}, manifest


def verify_checkpoint(catalog: Catalog, step: int, retry: ReadRetry | None = None, on_bytes=None) -> None:
    """Check that checkpoint `step` covers every tensor and every block's CRC32 matches.

    Reads the whole checkpoint but holds only the ranges in flight; raises CorruptCheckpoint
    (proof), or TransientStorageError when the store kept failing (proves nothing).
    `on_bytes(n, total)` follows the reads (ckpt.fetch.fetch).
    """
    retry = retry if retry is not None else ReadRetry()  # one budget for the manifest and every piece
    manifest = read_manifest(catalog, step, retry)
    plan = _plan(manifest, step, _whole_targets(manifest, list(manifest.tensors)))
    fetch(catalog.storage, step, plan.reads, keep=False, retry=retry, on_bytes=on_bytes)


def verify_location(catalog: Catalog, step: int, location: tuple[str, int, int], retry: ReadRetry | None = None) -> int:
    """Check the blocks of checkpoint `step` that hold bytes [start, end) of its shard `file`
    (`location`, as CorruptCheckpoint carries it), or its manifest (file MANIFEST_NAME): what a
    rank's failed read proved, checked in milliseconds instead of reading the whole checkpoint. Returns the bytes
    checked; raises CorruptCheckpoint (proof, also when the manifest names no such bytes) or
    TransientStorageError, as verify_checkpoint does."""
    file, start, end = location
    retry = retry if retry is not None else ReadRetry()
    manifest = read_manifest(catalog, step, retry)  # the proof of a manifest's location (MANIFEST_NAME)
    if file == MANIFEST_NAME:
        return 0
    plan = _plan(manifest, step, _whole_targets(manifest, list(manifest.tensors)))
    reads = []
    for read in plan.reads:
        blocks = tuple(b for b in read.blocks if read.file == file and b.start < end and b.end > start)
        if blocks:
            reads.append(RangeRead(file, blocks[0].start, blocks[-1].end, blocks))
    if not reads:
        raise CorruptCheckpoint(f"step {step}: the manifest names no bytes {start}..{end} of {file}")
    fetch(catalog.storage, step, reads, keep=False, retry=retry)
    return sum(r.end - r.start for r in reads)


def newest_loadable(catalog: Catalog, on_fallback=None) -> int | None:
    """The newest committed checkpoint that verifies, walking back past corrupt ones.

    `on_fallback(step, error)` is called for each skipped checkpoint so the caller can log
    and count it; this function also logs at ERROR level, since silently resuming from an
    older state would silently redo work.
    """
    for step in reversed(catalog.committed_steps()):
        try:
            verify_checkpoint(catalog, step)
            return step
        except CorruptCheckpoint as err:
            log.error("checkpoint step %d is unusable, falling back to the previous one: %s", step, err)
            if on_fallback is not None:
                on_fallback(step, err)
    return None


def _whole_targets(manifest: Manifest, names: list[str]) -> list[TensorSlice]:
    targets = []
    for name in names:
        entry = manifest.tensors[name]
        shape = tuple(entry.shape)
        targets.append(TensorSlice(name=name, dtype=dtype_from_name(entry.dtype), global_shape=shape,
                                   offsets=(0,) * len(shape), lengths=shape))
    return targets


def _plan(manifest: Manifest, step: int, targets: Sequence[TensorSlice], coalesce_gap: int = COALESCE_GAP) -> ReadPlan:
    try:
        return plan_reads(manifest.tensors, targets, coalesce_gap=coalesce_gap)
    except CoverageError as err:
        raise CorruptCheckpoint(f"step {step}: {err}") from err


def _source(ranges: list[tuple[int, torch.Tensor]], starts: list[int], copy: Copy) -> torch.Tensor:
    """The stored region of `copy` as a strided view over the fetched bytes (no copy when possible)."""
    size = itemsize(copy.dtype)
    strides = row_major_strides(copy.chunk_shape)
    first = sum(o * s for o, s in zip(copy.src_offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(copy.src_offsets, copy.lengths, strides, strict=True))
    begin, end = copy.chunk_start + first * size, copy.chunk_start + (last + 1) * size
    raw = _span(ranges, starts, begin, end)
    if raw.storage_offset() % size:  # a range that began at a narrower tensor (a safetensors file not
        raw = raw.clone()            # written by the library, which orders by alignment): realign it
    return raw.view(dtype_from_name(copy.dtype)).as_strided(copy.lengths, strides)


def _span(ranges: list[tuple[int, torch.Tensor]], starts: list[int], begin: int, end: int) -> torch.Tensor:
    """Bytes [begin, end) of a file from its fetched ranges, which hold every needed block of it.

    Usually one range holds the whole span and a view is returned. When the span crosses
    ranges (a column slice whose rows lie far apart), the bytes between them were not
    fetched because no element of the slice lies there; the gap stays uninitialised.
    """
    i = bisect.bisect_right(starts, begin) - 1
    if i >= 0:
        start, data = ranges[i]
        if start + len(data) >= end:
            return data[begin - start:end - start]
    out = torch.empty(end - begin, dtype=torch.uint8)
    for start, data in ranges[max(i, 0):]:
        if start >= end:
            break
        lo, hi = max(start, begin), min(start + len(data), end)
        if lo < hi:
            out[lo - begin:hi - begin] = data[lo - start:hi - start]
    return out
