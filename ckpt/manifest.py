"""The checkpoint manifest: the one file that makes a checkpoint exist.

A checkpoint directory `<root>/step-<step>/` holds immutable shard files (one per rank)
and, once committed, `manifest.json`. The manifest lists every logical tensor (stable
name, dtype, global shape) and the chunks that store it: a rectangular slice (offsets,
lengths) of the unsharded tensor, the shard file, the byte range inside it, and a CRC32
per fixed-size block of those bytes (ckpt.blocks), so that a partial read is verified too.
A reader trusts nothing that no committed manifest names (docs/design.md invariant 1), and can
assemble any slice of any tensor from the chunk list alone (invariant 2, ckpt.reshard).

Schema history: 1 = one CRC32 per chunk, whole-tensor chunks; 2 = per-block CRC32s and
arbitrary rectangular chunks. Only the current version is read; any other is refused
with `UnsupportedManifest` rather than misread.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt.blocks import block_count
from ckpt.coverage import check_coverage
from ckpt.errors import IncompleteCheckpoint, UnsupportedManifest

SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{9})$")


class Chunk(BaseModel):
    """One stored rectangular slice of a logical tensor: row-major bytes in one shard file."""

    model_config = ConfigDict(extra="forbid")
    offsets: list[int]
    lengths: list[int]
    file: str  # shard file name, relative to the checkpoint directory
    byte_offset: int
    nbytes: int
    block_bytes: int  # block i covers [byte_offset + i * block_bytes, ...), the last one may be short
    block_crc32: list[int]

    @model_validator(mode="after")
    def _blocks_match_bytes(self) -> Chunk:
        if len(self.block_crc32) != block_count(self.nbytes, self.block_bytes):
            raise ValueError(
                f"{self.file}@{self.byte_offset}: {len(self.block_crc32)} block checksums for "
                f"{self.nbytes} bytes in blocks of {self.block_bytes}"
            )
        return self


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: list[int]
    chunks: list[Chunk] = Field(default_factory=list)


class ShardReceipt(BaseModel):
    """What a rank reports after its shard file is durably written (rank -> controller).

    `tensors` names every logical tensor the rank holds, with the chunks it wrote; a
    tensor whose slices other replicas wrote appears with no chunks, so the commit can
    tell "nobody wrote it" from "nobody holds it".
    """

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

    @model_validator(mode="before")
    @classmethod
    def _known_schema(cls, data):
        # Checked before any field, so an old or newer manifest gets this message and not a
        # list of missing and unexpected fields.
        version = data.get("schema_version", SCHEMA_VERSION) if isinstance(data, dict) else SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            raise UnsupportedManifest(
                f"checkpoint manifest of job {data.get('job')!r} step {data.get('step')} has schema_version "
                f"{version}, but this undying reads schema_version {SCHEMA_VERSION} only; read it with the "
                f"undying version that wrote it, or start from a checkpoint written by this one"
            )
        return data


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def merge_receipts(receipts: list[ShardReceipt]) -> dict[str, TensorEntry]:
    """Union of the chunks every rank wrote, one entry per logical tensor; checked for commit.

    Called by the controller (`Catalog.commit`) before the manifest is created. Raises
    `IncompleteCheckpoint` when ranks disagree on a tensor's dtype or global shape, when a
    chunk names a file other than its rank's shard, or when the chunks of any tensor do
    not tile it exactly (a gap, an overlap, a slice written twice, a tensor nobody wrote):
    any of these is a bug in the writers and must never become a committed checkpoint.
    """
    merged: dict[str, TensorEntry] = {}
    for receipt in sorted(receipts, key=lambda r: r.rank):
        for name, entry in receipt.tensors.items():
            stray = [c.file for c in entry.chunks if c.file != receipt.file]
            if stray:
                raise IncompleteCheckpoint(f"rank {receipt.rank} reported chunks of {name} in {stray[0]}, "
                                           f"not in its own shard {receipt.file}")
            have = merged.get(name)
            if have is None:
                merged[name] = TensorEntry(dtype=entry.dtype, shape=entry.shape, chunks=list(entry.chunks))
                continue
            if (have.dtype, have.shape) != (entry.dtype, entry.shape):
                raise IncompleteCheckpoint(
                    f"rank {receipt.rank} wrote {name} as {entry.dtype}{entry.shape}, "
                    f"another rank as {have.dtype}{have.shape}"
                )
            have.chunks.extend(entry.chunks)
    for name, entry in merged.items():
        check_coverage(name, entry.shape, [(c.offsets, c.lengths, c.file) for c in entry.chunks])
    return merged
