"""Read a committed checkpoint back: byte ranges, checksums, assembly of logical tensors.

Protocol: every rank that restores calls `load_checkpoint(catalog, step, names)` for the
tensors its layout needs. Only byte ranges named by the committed manifest are read (range
requests on object storage), and every chunk's CRC32 is verified before use. A mismatch or
a missing shard raises `CorruptCheckpoint`; the controller then marks that step bad and
restores the previous committed one, loudly (log line and metric), never silently.
`newest_loadable` performs the same walk for tools that verify a whole checkpoint offline.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterable

import torch

from ckpt.catalog import Catalog
from ckpt.manifest import Manifest, TensorEntry, step_dir
from ckpt.shards import dtype_from_name, tensor_from_bytes

log = logging.getLogger(__name__)


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint cannot be read back intact (missing shard, bad checksum)."""


def _read_entry(catalog: Catalog, step: int, name: str, entry: TensorEntry) -> torch.Tensor:
    full = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
    covered = 0
    for chunk in entry.chunks:
        path = catalog.storage.path(step_dir(step), chunk.file)
        try:
            data = catalog.storage.read_range(path, chunk.byte_offset, chunk.byte_offset + chunk.nbytes)
        except (FileNotFoundError, OSError) as err:
            raise CorruptCheckpoint(f"step {step}: cannot read {chunk.file} for {name}: {err}") from err
        if len(data) != chunk.nbytes or zlib.crc32(data) != chunk.crc32:
            raise CorruptCheckpoint(f"step {step}: checksum mismatch in {chunk.file} for {name}")
        piece = tensor_from_bytes(data, entry.dtype, chunk.lengths)
        index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.lengths, strict=True))
        full[index] = piece
        covered += piece.numel()
    if covered != full.numel():
        raise CorruptCheckpoint(f"step {step}: chunks of {name} cover {covered} of {full.numel()} elements")
    return full


def load_checkpoint(
    catalog: Catalog, step: int, names: Iterable[str] | None = None
) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Tensors `names` (all when None) of committed checkpoint `step`, verified, plus its manifest."""
    try:
        manifest = catalog.read_manifest(step)
    except FileNotFoundError as err:
        raise CorruptCheckpoint(f"step {step} has no committed manifest") from err
    wanted = list(manifest.tensors) if names is None else list(names)
    missing = [n for n in wanted if n not in manifest.tensors]
    if missing:
        raise KeyError(f"checkpoint step {step} has no tensors {missing[:5]}")
    tensors = {n: _read_entry(catalog, step, n, manifest.tensors[n]) for n in wanted}
    return tensors, manifest


def verify_checkpoint(catalog: Catalog, step: int) -> None:
    """Read and checksum every chunk of checkpoint `step`; raise CorruptCheckpoint on any fault."""
    load_checkpoint(catalog, step)


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
