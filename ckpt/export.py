"""Export the model weights of a committed checkpoint as safetensors files, for inference.

Format (https://huggingface.co/docs/safetensors, "Format"): an 8-byte little-endian
unsigned header length N, then N bytes of JSON header, then the tensors' raw bytes back to
back. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the start of the byte buffer, which has no holes) and may carry a
"__metadata__" map of strings. The header is padded with spaces to a multiple of 8 bytes
and tensors are laid out largest element size first, so every tensor starts aligned to its
element size (what zero-copy loaders expect).

Protocol: `plan_export` orders the tensors of one file, `write_safetensors` writes it (also
used per shard by ckpt.hf_export). The header is computed from the manifest alone (dtype and
shape of every tensor, or the dtype cast to), then the tensors are read in batches of at
most `batch_bytes` through the reader, which verifies every chunk's checksum, so memory
stays bounded by one batch whatever the model size. The file is written under a temporary
name and renamed when complete: a failed export never leaves a file that looks like a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import torch

from ckpt.catalog import Catalog
from ckpt.manifest import Manifest
from ckpt.reader import load_checkpoint

SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
}
DEFAULT_BATCH_BYTES = 1 << 30


def model_tensor_names(manifest: Manifest, prefix: str) -> dict[str, str]:
    """Stored name -> exported name (the prefix removed) of every tensor under `prefix`."""
    return {name: name[len(prefix):] for name in sorted(manifest.tensors) if name.startswith(prefix)}


@dataclass(frozen=True)
class Exported:
    """One tensor of an exported file: its stored name, its name in the file, dtype (torch name), shape."""

    stored: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * _itemsize(self.dtype)


def plan_export(manifest: Manifest, names: dict[str, str], dtype: str | None = None) -> list[Exported]:
    """`names` (stored -> exported) of `manifest` in file order: largest element size first
    (alignment), then by exported name; `dtype` casts floating-point tensors (None: as stored)."""
    out = []
    for stored, name in names.items():
        entry = manifest.tensors[stored]
        cast = dtype if dtype is not None and getattr(torch, entry.dtype).is_floating_point else entry.dtype
        out.append(Exported(stored, name, cast, tuple(entry.shape)))
    return _file_order(out)


def _file_order(tensors: list[Exported]) -> list[Exported]:
    """Largest element size first (every tensor then starts aligned to its size), then by name."""
    return sorted(tensors, key=lambda t: (-_itemsize(t.dtype), t.name))


def safetensors_header(tensors: list[Exported], metadata: dict[str, str]) -> bytes:
    """The length prefix and padded JSON header for `tensors`, laid out in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {t.stored} has dtype {t.dtype}, which safetensors cannot store")
        header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _batches(tensors: list[Exported], batch_bytes: int) -> Iterator[list[Exported]]:
    batch: list[Exported] = []
    size = 0
    for t in tensors:
        if batch and size + t.nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += t.nbytes
    if batch:
        yield batch


@contextlib.contextmanager
def _atomic_file(out_path: str) -> Iterator[BinaryIO]:
    """A file written under a temporary name, flushed to disk and renamed to `out_path` when the
    block completes; removed when it raises, so no half file ever looks like a model."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian bytes; export on a little-endian machine")
    tmp = f"{out_path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_safetensors(catalog: Catalog, step: int, out_path: str, tensors: list[Exported],
                      metadata: dict[str, str], batch_bytes: int = DEFAULT_BATCH_BYTES, on_bytes=None,
                      manifest: Manifest | None = None) -> None:
    """Write `tensors` of committed checkpoint `step` to the local file `out_path` (through a
    temporary name, renamed when complete). Reads batches of at most `batch_bytes` through the
    verifying reader, every batch by the one `manifest` the export planned with (read here when
    None): a step quarantined and committed again by a running job mid-export must not mix two
    checkpoints in one file, each byte verifying. CorruptCheckpoint when a chunk is damaged (or
    gone). `on_bytes(n)`: called after each batch with the bytes it wrote (a command's progress)."""
    manifest = manifest or catalog.read_manifest(step)
    with _atomic_file(out_path) as f:
        f.write(safetensors_header(tensors, metadata))
        for batch in _batches(tensors, batch_bytes):
            loaded, _ = load_checkpoint(catalog, step, [t.stored for t in batch], manifest)
            for t in batch:
                f.write(_raw(loaded.pop(t.stored).to(getattr(torch, t.dtype))))
            if on_bytes is not None:
                on_bytes(sum(t.nbytes for t in batch))


def write_tensors(out_path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write in-memory `tensors` (name -> tensor) as one safetensors file at `out_path`, atomically."""
    layout = _file_order([Exported(n, n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                          for n, t in tensors.items()])
    with _atomic_file(out_path) as f:
        f.write(safetensors_header(layout, metadata))
        for t in layout:
            f.write(_raw(tensors[t.name]))


def export_safetensors(
    catalog: Catalog, step: int, out_path: str, prefix: str = "model/",
    batch_bytes: int = DEFAULT_BATCH_BYTES, on_bytes=None,
) -> dict[str, str]:
    """Write the tensors under `prefix` of committed checkpoint `step` to `out_path` (a local
    file), without the prefix; returns stored name -> exported name. Raises ValueError when
    the checkpoint has no tensor under `prefix`, CorruptCheckpoint when a chunk is damaged.
    `on_bytes(n, total)` follows the bytes written (total: the file's tensor bytes)."""
    manifest = catalog.read_manifest(step)
    names = model_tensor_names(manifest, prefix)
    if not names:
        raise ValueError(f"checkpoint step {step} has no tensors under {prefix!r}")
    metadata = {"format": "pt", "undying.job": manifest.job, "undying.step": str(step)}
    tensors = plan_export(manifest, names)
    total = sum(t.nbytes for t in tensors)
    write_safetensors(catalog, step, out_path, tensors, metadata, batch_bytes,
                      on_bytes=None if on_bytes is None else lambda n: on_bytes(n, total), manifest=manifest)
    return names


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _raw(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()
