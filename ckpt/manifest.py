"""The checkpoint manifest: the one file that makes a checkpoint exist.

A checkpoint directory `<root>/step-<step>/` holds immutable shard files and, once
committed, `manifest.json`. The manifest lists every logical tensor (stable name, dtype,
global shape) and the chunks that store it: a rectangular slice (offsets, lengths) of the
unsharded tensor, the shard file, the byte range inside it and a CRC32 of those bytes. A
reader trusts nothing that no committed manifest names (design.md invariant 1), and can
assemble any slice of any tensor from the chunk list alone (invariant 2).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class Chunk(BaseModel):
    """One stored rectangular slice of a logical tensor."""

    model_config = ConfigDict(extra="forbid")
    offsets: list[int]
    lengths: list[int]
    file: str  # shard file name, relative to the checkpoint directory
    byte_offset: int
    nbytes: int
    crc32: int


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: list[int]
    chunks: list[Chunk] = Field(default_factory=list)


class ShardReceipt(BaseModel):
    """What a rank reports after its shard file is durably written (rank -> controller)."""

    model_config = ConfigDict(extra="forbid")
    step: int
    rank: int
    file: str
    nbytes: int
    tensors: dict[str, TensorEntry]
    blocking_s: float  # time the rank's training loop was stopped for this save
    write_s: float  # time spent writing and checksumming the shard


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    job: str
    step: int  # the number of optimizer steps the saved state has taken (resume computes this step next)
    generation: int
    layout: dict
    spec_hash: str
    created_at: float
    tensors: dict[str, TensorEntry]
    state: dict  # non-tensor training state: data cursor, scheduler, goodput ledger, ...
    total_bytes: int


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def merge_receipts(receipts: list[ShardReceipt]) -> dict[str, TensorEntry]:
    """Union of the chunks every rank wrote, one entry per logical tensor.

    Raises ValueError when two ranks disagree on a tensor's dtype or global shape: that is
    a bug in the writers and must never become a committed checkpoint.
    """
    merged: dict[str, TensorEntry] = {}
    for receipt in sorted(receipts, key=lambda r: r.rank):
        for name, entry in receipt.tensors.items():
            have = merged.get(name)
            if have is None:
                merged[name] = TensorEntry(dtype=entry.dtype, shape=entry.shape, chunks=list(entry.chunks))
                continue
            if (have.dtype, have.shape) != (entry.dtype, entry.shape):
                raise ValueError(
                    f"rank {receipt.rank} wrote {name} as {entry.dtype}{entry.shape}, "
                    f"another rank as {have.dtype}{have.shape}"
                )
            have.chunks.extend(entry.chunks)
    return merged
