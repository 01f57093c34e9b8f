"""Fuzz the safetensors header reader: any file gives its tensors or a BadSafetensors (a
ValueError naming the file), never another exception."""

from __future__ import annotations

import json
import struct
import uuid

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save

from ckpt.safetensors_source import BadSafetensors, file_entries, parse_header
from ckpt.storage import Storage
from tests._fuzz import fuzz, mutated, mutated_bytes

VALID = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
              "c": torch.zeros((), dtype=torch.int64)}, metadata={"format": "pt"})
(_LENGTH,) = struct.unpack("<Q", VALID[:8])
HEADER, DATA = json.loads(VALID[8:8 + _LENGTH]), VALID[8 + _LENGTH:]


def _parses_cleanly(data: bytes) -> None:
    try:
        start, header = parse_header(data, len(data), "model.safetensors")
    except BadSafetensors as err:
        assert "model.safetensors" in str(err)
        return
    assert 8 <= start <= len(data) and isinstance(header, dict)


def _with_header(header) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + DATA


def test_the_valid_file_parses():
    _, header = parse_header(VALID, len(VALID), "model.safetensors")
    assert set(header) == {"a", "b", "c"}


@fuzz(150)
@given(st.binary(max_size=200))
def test_random_bytes(data):
    _parses_cleanly(data)


@fuzz(150)
@given(mutated_bytes(VALID))
def test_byte_mutations_of_a_valid_file(data):
    _parses_cleanly(data)


@fuzz(200)
@given(mutated(HEADER, values=st.recursive(st.none() | st.booleans() | st.integers(-2, 2**65) | st.text(max_size=6)
                                           | st.sampled_from(["F32", "BF16", "I64", "U8"]),
                                           lambda inner: st.lists(inner, max_size=3)
                                           | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                           max_leaves=8)))
def test_json_mutations_of_a_valid_header(header):
    _parses_cleanly(_with_header(header))


@fuzz(30)
@given(mutated_bytes(VALID))
def test_the_reader_over_storage(data):
    storage = Storage(f"memory://fuzz-safetensors/{uuid.uuid4().hex}")
    storage.fs.pipe_file(storage.path("model.safetensors"), data)
    try:
        entries = file_entries(storage, "model.safetensors")
    except BadSafetensors:
        return
    finally:
        storage.fs.rm(storage.root, recursive=True)
    for entry in entries.values():
        [chunk] = entry.chunks
        assert chunk.byte_offset + chunk.nbytes <= len(data)


def test_inputs_the_fuzzer_found():
    for header in ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},  # unhashable dtype
                   {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "nested": [[[[]]]]}):
        _parses_cleanly(_with_header(header))
    deep = b"[" * 50_000
    _parses_cleanly(struct.pack("<Q", len(deep)) + deep)  # nested too deeply for the JSON parser


def test_a_wider_tensor_after_a_narrower_one_in_one_read_loads_realigned(tmp_path):
    """A file another writer laid out with a bf16 tensor at a file offset of 2 mod 4 followed by an
    f32 one (each aligned to its own size, as safetensors requires): read as one range, the f32's
    bytes sit at an offset of 2 mod 4 in the buffer, which torch cannot view as f32 in place."""
    import struct

    from ckpt.fetch import fetch
    from ckpt.reader import assemble
    from ckpt.reshard import plan_reads
    from ckpt.safetensors_source import directory_entries
    from ckpt.storage import Storage
    from trainer.state_slices import TensorSlice

    a, b = torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([3.25, -7.0])
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}).encode()
    header += b" " * ((2 - 8 - len(header)) % 4)  # data starts at 2 mod 4
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + a.view(torch.uint8)
                                                 .numpy().tobytes() + b.view(torch.uint8).numpy().tobytes())
    storage = Storage(f"file://{tmp_path}")
    targets = [TensorSlice("a", torch.bfloat16, (1,), (0,), (1,)), TensorSlice("b", torch.float32, (2,), (0,), (2,))]
    plan = plan_reads(directory_entries(storage), targets)
    assert len(plan.reads) == 1  # both in one range
    got = assemble(targets, plan, fetch(storage, None, plan.reads))
    assert torch.equal(got[0].tensor, a) and torch.equal(got[1].tensor, b)
