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

A manifest's bytes are untrusted input (anyone who can write to the store can write one):
`parse_manifest` turns anything that is not UTF-8 JSON of this schema into a one-line
`CorruptCheckpoint`, and a chunk's `file` must be one plain file name (`SHARD_FILE`: no
separator, no `..`, no leading dot), so no manifest can make a reader open a path outside its
checkpoint directory.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ckpt.blocks import block_count
from ckpt.coverage import check_coverage
from ckpt.errors import CorruptCheckpoint, IncompleteCheckpoint, UnsupportedManifest

SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{9})$")
# One file name inside the checkpoint directory: what ckpt.shards.shard_file_name makes.
SHARD_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _plain_file_name(name: str) -> str:
    if not SHARD_FILE.fullmatch(name):
        raise ValueError(f"shard file {name[:80]!r} is not a plain file name inside the checkpoint directory "
                         "(letters, digits, '.', '_', '-'; no separator, no leading dot)")
    return name


FileName = Annotated[str, AfterValidator(_plain_file_name)]
NonNegative = Annotated[int, Field(ge=0)]


class Chunk(BaseModel):
    """One stored rectangular slice of a logical tensor: row-major bytes in one shard file."""

    model_config = ConfigDict(extra="forbid")
    offsets: list[NonNegative]
    lengths: list[NonNegative]
    file: FileName  # shard file name, relative to the checkpoint directory
    byte_offset: NonNegative
    nbytes: NonNegative
    block_bytes: int = Field(gt=0)  # block i covers [byte_offset + i * block_bytes, ...), the last one may be short
    block_crc32: list[int]

    @model_validator(mode="after")
    def _blocks_match_bytes(self) -> Chunk:
        if len(self.block_crc32) != block_count(self.nbytes, self.block_bytes):
            raise ValueError(
                f"{self.file}@{self.byte_offset}: {len(self.block_crc32)} block checksums for "
                f"{self.nbytes} bytes in blocks of {self.block_bytes}"
            )
        return self


def _torch_dtype(name: str) -> str:
    """`name` when torch has a dtype of that name, found as the manifest parses rather than when its
    reads are planned. One it lacks is UnsupportedManifest, not corruption: a newer torch's dtype
    (a float8 variant) and a damaged name cannot be told apart, and a checkpoint is withdrawn only on
    proof, so it is kept, and the job fails naming the dtype."""
    import torch  # here: who parses a manifest reads tensors next, and the module stays importable without

    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise UnsupportedManifest(f"the manifest names dtype {name!r}, which this torch ({torch.__version__}) does "
                                  "not have: read it with the torch that wrote it (or, if the name is garbled, the "
                                  "manifest is damaged: `undying ckpt verify` and an older step)")
    return name


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: Annotated[str, AfterValidator(_torch_dtype)]  # torch dtype name without "torch.", e.g. "float32"
    shape: list[NonNegative]
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
    file: FileName
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
    total_bytes: NonNegative  # of the shard files: sets the restore's time limit (orchestrator.controller.timeouts)

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


def parse_manifest(data: bytes, step: int) -> Manifest:
    """The manifest in `data`, read from step `step`'s directory. Raises CorruptCheckpoint, with
    a one-line message, for bytes that are not UTF-8 JSON of this schema, that name another
    step, or whose chunks do not tile a tensor; UnsupportedManifest for another schema version,
    or for this one plus unknown fields."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise CorruptCheckpoint(f"step {step}: the manifest is not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise CorruptCheckpoint(f"step {step}: the manifest is not JSON ({err.msg}: line {err.lineno} "
                                f"column {err.colno})") from None
    except RecursionError:
        raise CorruptCheckpoint(f"step {step}: the manifest is not JSON (nested too deeply)") from None
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as err:
        _refuse_unknown_fields(err, raw, step)
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the top level"
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise CorruptCheckpoint(f"step {step}: the manifest does not parse: {where}: "
                                f"{' '.join(first['msg'].split())}{more}") from None
    if manifest.step != step:
        raise CorruptCheckpoint(f"step {step}: the manifest is that of step {manifest.step}")
    # The training state carries no checksum of its own: a flipped digit of its step would resume
    # every rank at another step, the data and the schedule shifted, with every tensor intact.
    engine = manifest.state.get("engine")
    if isinstance(engine, dict) and "next_step" in engine and engine["next_step"] != step:
        raise CorruptCheckpoint(f"step {step}: the manifest's training state resumes at step {engine['next_step']}")
    try:  # committed only so: a chunk that moved (a flipped digit of an offset) would load garbage
        check_tiling(manifest.tensors)
    except IncompleteCheckpoint as err:
        raise CorruptCheckpoint(f"step {step}: the manifest's chunks do not tile the tensor {err}") from None
    # The shard files hold at least their chunks: a size below that (a flipped digit) would give the
    # restore a time limit too short for its bytes, and the ranks would be killed as hung, every rerun.
    stored = _stored_bytes(manifest.tensors)
    if manifest.total_bytes < stored:
        raise CorruptCheckpoint(f"step {step}: the manifest's total_bytes {manifest.total_bytes} is below the "
                                f"{stored} bytes its chunks occupy")
    return manifest


def _stored_bytes(tensors: dict[str, TensorEntry]) -> int:
    """The bytes the chunks reach into their files: per file, the furthest chunk end."""
    ends: dict[str, int] = {}
    for entry in tensors.values():
        for chunk in entry.chunks:
            ends[chunk.file] = max(ends.get(chunk.file, 0), chunk.byte_offset + chunk.nbytes)
    return sum(ends.values())


def _refuse_unknown_fields(err: ValidationError, raw: dict, step: int) -> None:
    """A manifest that is this schema plus fields only: a newer writer's, not damage. Corruption would
    move it aside; an unsupported manifest is refused with the version to read it with, and kept. A
    damaged key leaves a required field missing, or a defaulted one (a tensor's chunks) empty, so the
    manifest without the unknown fields must also be whole (parse, tile every tensor) to count."""
    errors = err.errors()
    if not errors or any(e["type"] != "extra_forbidden" for e in errors):
        return
    known = copy.deepcopy(raw)
    for e in errors:  # drop each unknown key where it is
        *parent, key = e["loc"]
        node = known
        for part in parent:
            node = node[part]
        node.pop(key, None)
    try:
        check_tiling(Manifest.model_validate(known).tensors)
    except (ValidationError, IncompleteCheckpoint):
        return  # damage: the caller reports it as such
    names = sorted({".".join(str(p) for p in e["loc"]) for e in errors})
    raise UnsupportedManifest(f"step {step}: the manifest has fields this undying does not know "
                              f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); it was written by a "
                              "newer undying: read it with that version") from None


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
    check_tiling(merged)
    return merged


def check_tiling(tensors: dict[str, TensorEntry]) -> None:
    """IncompleteCheckpoint unless every tensor's chunks tile it exactly (ckpt.coverage)."""
    for name, entry in tensors.items():
        check_coverage(name, entry.shape, [(c.offsets, c.lengths, c.file) for c in entry.chunks])
