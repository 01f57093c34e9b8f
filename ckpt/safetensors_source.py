"""safetensors files as a source of stored chunks: the header reader and the reshard planner's view.

A safetensors file (https://huggingface.co/docs/safetensors, "Format") is an 8-byte
little-endian header length N, N bytes of JSON header mapping each tensor name to
{"dtype", "shape", "data_offsets": [begin, end]} (relative to the byte buffer after the header),
then the bytes. A Hugging Face model directory holds `model.safetensors`, or several files and
`model.safetensors.index.json` whose `weight_map` names the file of each tensor.

Protocol: `hf_import` calls `directory_entries(storage)` once per loading rank; it reads only
the headers (two range reads per file) and returns, per tensor, a `TensorEntry`-shaped record
with one chunk covering the whole tensor, which `ckpt.reshard.plan_reads` turns into the byte
ranges of this rank's slices. safetensors carries no checksums: those blocks are read
unverified (their crc32 is None). Headers are untrusted bytes: every field is checked (size,
JSON, dtypes, shapes against offsets, offsets inside the file, no overlap) and a bad header
raises `BadSafetensors` naming the file and the problem.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from ckpt.blocks import BLOCK_BYTES, block_count
from ckpt.storage import Storage

# safetensors dtype -> torch dtype name (the manifest's spelling) and its size in bytes.
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8), "I32": ("int32", 4),
    "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's own limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class BadSafetensors(ValueError):
    """A safetensors file or index that does not parse or contradicts itself."""


class _NoChecksums:
    """The per-block checksum list of a chunk that has none: every block reads as None."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> None:
        if not 0 <= index < self.count:
            raise IndexError(index)
        return None


@dataclass(frozen=True)
class SafetensorsChunk:
    """A whole tensor stored in a safetensors file, shaped like `ckpt.manifest.Chunk` for the planner."""

    offsets: list[int]
    lengths: list[int]
    file: str
    byte_offset: int
    nbytes: int
    block_bytes: int = BLOCK_BYTES
    block_crc32: _NoChecksums = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        object.__setattr__(self, "block_crc32", _NoChecksums(block_count(self.nbytes, self.block_bytes)))


@dataclass(frozen=True)
class SafetensorsEntry:
    """A tensor's dtype (torch name), global shape and its one chunk, shaped like `TensorEntry`."""

    dtype: str
    shape: list[int]
    chunks: list[SafetensorsChunk]


def parse_header(prefix: bytes, file_size: int, file: str) -> tuple[int, dict]:
    """(data start, {name: header entry}) from the first bytes of a safetensors file.

    `prefix` holds at least the 8-byte length and the header; `file_size` bounds the offsets.
    """
    if len(prefix) < 8:
        raise BadSafetensors(f"{file}: {len(prefix)} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise BadSafetensors(f"{file}: header length {length} exceeds the file ({file_size} bytes) or the limit")
    if len(prefix) < 8 + length:
        raise BadSafetensors(f"{file}: the header is truncated")
    try:
        header = json.loads(prefix[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise BadSafetensors(f"{file}: the header is not UTF-8 JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise BadSafetensors(f"{file}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + length
    spans = sorted((_check_entry(file, name, entry, data_start, file_size), name) for name, entry in header.items())
    for (span, name), (next_span, other) in zip(spans, spans[1:], strict=False):
        if span[1] > next_span[0]:
            raise BadSafetensors(f"{file}: tensors {name} and {other} overlap")
    return data_start, header


def _check_entry(file: str, name: str, entry, data_start: int, file_size: int) -> tuple[int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BadSafetensors(f"{file}: tensor {name!r} needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadSafetensors(f"{file}: tensor {name!r} has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise BadSafetensors(f"{file}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        raise BadSafetensors(f"{file}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    numel = 1
    for n in shape:
        numel *= n
    begin, end = offsets
    if not 0 <= begin <= end or end - begin != numel * DTYPES[dtype][1] or data_start + end > file_size:
        raise BadSafetensors(f"{file}: tensor {name!r} spans bytes {begin}..{end}, which does not hold "
                             f"{shape} x {dtype} inside the file")
    if (data_start + begin) % DTYPES[dtype][1]:
        raise BadSafetensors(f"{file}: tensor {name!r} is not aligned to its element size; re-save the file with "
                             "the safetensors library")
    return begin, end


def file_entries(storage: Storage, file: str) -> dict[str, SafetensorsEntry]:
    """Every tensor of safetensors file `file` (relative to the storage root), from its header."""
    path = storage.path(file)
    try:
        size = storage.fs.size(path)
        (length,) = struct.unpack("<Q", storage.read_range(path, 0, 8).ljust(8, b"\0"))
        prefix = storage.read_range(path, 0, 8 + min(length, MAX_HEADER_BYTES, max(size - 8, 0)))
    except FileNotFoundError:
        raise BadSafetensors(f"{path}: no such file") from None
    data_start, header = parse_header(prefix, size, file)
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        torch_dtype, _ = DTYPES[entry["dtype"]]
        shape = list(entry["shape"])
        chunk = SafetensorsChunk(offsets=[0] * len(shape), lengths=shape, file=file,
                                 byte_offset=data_start + begin, nbytes=end - begin)
        out[name] = SafetensorsEntry(dtype=torch_dtype, shape=shape, chunks=[chunk])
    return out


def directory_entries(storage: Storage) -> dict[str, SafetensorsEntry]:
    """Every tensor of the Hugging Face model directory at the storage root: its single file, else its
    index (transformers' order: a save over a sharded one leaves the old index behind)."""
    if storage.exists(storage.path(SINGLE_NAME)):
        weight_map, files = None, [SINGLE_NAME]
    elif storage.exists(storage.path(INDEX_NAME)):
        try:
            index = json.loads(storage.read(storage.path(INDEX_NAME)).decode("utf-8"))
            weight_map = index["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise BadSafetensors(f"{INDEX_NAME}: not an index with a weight_map ({err})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise BadSafetensors(f"{INDEX_NAME}: its weight_map is not an object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
    else:
        raise BadSafetensors(f"{storage.root}: neither {SINGLE_NAME} nor {INDEX_NAME}; give a Hugging Face "
                             "model directory with safetensors weights")
    out: dict[str, SafetensorsEntry] = {}
    for file in files:
        for name, entry in file_entries(storage, file).items():
            if weight_map is not None and weight_map.get(name) != file:
                raise BadSafetensors(f"{file}: holds {name}, which {INDEX_NAME} places in {weight_map.get(name)}")
            out[name] = entry
    if weight_map is not None and set(weight_map) - set(out):
        raise BadSafetensors(f"{INDEX_NAME}: names {sorted(set(weight_map) - set(out))[0]}, which no file holds")
    return out


def read_elements(storage: Storage, entry: SafetensorsEntry, start: int, count: int, itemsize: int) -> bytes:
    """The raw bytes of elements start..start+count of a tensor (`itemsize` bytes each), one range read:
    for the tools that look at a few values without loading the tensor (ckpt.hf_import's tied-head check,
    ckpt.hf_identity's sample)."""
    chunk = entry.chunks[0]
    return storage.read_range(storage.path(chunk.file), chunk.byte_offset + start * itemsize,
                              chunk.byte_offset + (start + count) * itemsize)
