"""The tokenized-dataset format (trainer/tokens): shard encoding, the manifest, and `TokenDataset`
reads on file:// (memory maps) and memory:// (ranged reads), with the errors a reader gives."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid

import fsspec
import numpy as np
import pytest

from trainer.tokens import NoManifest, TokenDataset, TokenFormatError, TokenManifest, dtype_for_vocab
from trainer.tokens.format import encode_shard, manifest_bytes, parse_manifest, shard_entry


def write_dataset(url: str, shards: list[list[list[int]]], vocab_size: int = 1000, eos_id: int = 1) -> np.ndarray:
    """Write `shards` (each a list of documents, each a list of ids) at `url`; returns the stream."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    entries, stream = [], []
    for index, docs in enumerate(shards):
        tokens = np.array([t for d in docs for t in d], dtype=np.int64)
        ends = np.cumsum([len(d) for d in docs]).astype(np.int64)
        tokens_bytes, docs_bytes = encode_shard(tokens, ends, dtype)
        entry = shard_entry(index, tokens_bytes, docs_bytes, 2 if dtype == "uint16" else 4)
        fs.pipe_file(f"{root}/{entry.name}.tokens", tokens_bytes)
        fs.pipe_file(f"{root}/{entry.name}.docs", docs_bytes)
        entries.append(entry)
        stream += tokens.tolist()
    manifest = TokenManifest(dtype=dtype, vocab_size=vocab_size, eos_id=eos_id, tokenizer_sha256="0" * 64,
                             tokenizer="test", text_field="text", inputs=["a.txt"], n_tokens=len(stream),
                             n_documents=sum(len(s) for s in shards), shards=entries)
    fs.pipe_file(f"{root}/manifest.json", manifest_bytes(manifest))
    return np.array(stream, dtype=np.int64)


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path}/data"
        return
    root = f"undying-tokens-{uuid.uuid4().hex}"
    yield f"memory://{root}/data"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(f"/{root}", recursive=True)


SHARDS = [[[5, 6, 1], [7, 1]], [], [[8, 9, 10, 11, 1]], [[12, 1], [1], [13, 14, 1]]]


def test_read_spans_shard_boundaries_and_skips_empty_shards(url):
    stream = write_dataset(url, SHARDS)
    ds = TokenDataset(url)
    assert (ds.n_tokens, ds.n_documents, ds.dtype, ds.eos_id) == (len(stream), 6, np.dtype("<u2"), 1)
    assert ds.offsets.tolist() == [0, 5, 5, 10, 16]
    for start in range(len(stream) + 1):
        for length in range(len(stream) - start + 1):
            got = ds.read(start, length)
            assert got.dtype == np.int64 and got.tolist() == stream[start:start + length].tolist()
    assert ds.document_bounds().tolist() == [3, 5, 10, 12, 13, 16]
    with pytest.raises(IndexError):
        ds.read(len(stream) - 1, 2)
    with pytest.raises(IndexError):
        ds.read(-1, 1)


def test_uint32_ids_round_trip(url):
    big = 70_000
    stream = write_dataset(url, [[[big - 1, 65_536, 2], [3, 2]]], vocab_size=big, eos_id=2)
    ds = TokenDataset(url)
    assert ds.manifest.dtype == "uint32" and ds.read(0, 5).tolist() == stream.tolist()


def test_concurrent_reads_agree(url):
    rng = np.random.default_rng(0)
    shards = [[rng.integers(0, 999, size=int(rng.integers(1, 50))).tolist() for _ in range(8)] for _ in range(6)]
    stream = write_dataset(url, shards)
    ds = TokenDataset(url)
    errors = []

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        for _ in range(200):
            start = int(r.integers(0, len(stream)))
            length = int(r.integers(0, len(stream) - start + 1))
            if ds.read(start, length).tolist() != stream[start:start + length].tolist():
                errors.append((start, length))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_dtype_boundary():
    assert dtype_for_vocab(65_536) == "uint16" and dtype_for_vocab(65_537) == "uint32"
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


def test_manifest_bytes_are_deterministic_and_checked():
    stream_docs = [[1, 2, 3]]
    tokens, docs = encode_shard(np.array(stream_docs[0]), np.array([3]), "uint16")
    entry = shard_entry(0, tokens, docs, 2)
    fields = dict(dtype="uint16", vocab_size=10, eos_id=3, tokenizer_sha256="ab", tokenizer="t", text_field="text",
                  inputs=["x"], n_tokens=3, n_documents=1, shards=[entry])
    assert manifest_bytes(TokenManifest(**fields)) == manifest_bytes(TokenManifest(**fields))
    assert parse_manifest(manifest_bytes(TokenManifest(**fields)), "m") == TokenManifest(**fields)
    for bad, why in (({"n_tokens": 4}, "n_tokens"), ({"dtype": "uint32"}, "dtype"), ({"eos_id": 10}, "eos_id")):
        raw = {**json.loads(manifest_bytes(TokenManifest(**fields))), **bad}
        with pytest.raises(TokenFormatError, match=why):
            parse_manifest(json.dumps(raw).encode(), "where/manifest.json")
    raw = {**json.loads(manifest_bytes(TokenManifest(**fields))), "surprise": 1}
    with pytest.raises(TokenFormatError, match="where/manifest.json: surprise"):
        parse_manifest(json.dumps(raw).encode(), "where/manifest.json")


def test_reader_errors_name_the_file_and_the_fix(tmp_path):
    url = f"file://{tmp_path}/d"
    with pytest.raises(NoManifest, match=r"no manifest.json at .*/d: run `undying data prepare` first"):
        TokenDataset(url)
    write_dataset(url, SHARDS)
    manifest = tmp_path / "d" / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(good[:40])
    with pytest.raises(TokenFormatError, match=r"d/manifest.json: not valid JSON"):
        TokenDataset(url)
    manifest.write_text(json.dumps({**json.loads(good), "format": "something-else"}))
    with pytest.raises(TokenFormatError, match=r"format is 'something-else', not 'undying-tokens'"):
        TokenDataset(url)
    manifest.write_text(json.dumps({**json.loads(good), "version": 2}))
    with pytest.raises(TokenFormatError, match=r"format version 2 is not supported"):
        TokenDataset(url)
    manifest.write_bytes(good)
    shard = tmp_path / "d" / "shard-000003.tokens"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(TokenFormatError, match=r"shard-000003.tokens: 10 bytes where the manifest says 12"):
        TokenDataset(url).read(10, 1)


def test_truncated_shard_on_an_object_store_is_named():
    name = f"undying-tokens-{uuid.uuid4().hex}"
    url = f"memory://{name}/d"
    write_dataset(url, SHARDS)
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/shard-000003.tokens", fs.cat_file(f"{root}/shard-000003.tokens")[:4])
    ds = TokenDataset(url)
    assert ds.read(0, 10).tolist() == [5, 6, 1, 7, 1, 8, 9, 10, 11, 1]
    with pytest.raises(TokenFormatError, match=r"shard-000003.tokens: 0 bytes where 2 were expected at byte 4"):
        ds.read(12, 1)
    fs.rm(f"/{name}", recursive=True)


def test_local_shards_keep_a_bounded_number_of_maps_open(tmp_path, monkeypatch):
    # Windows land on every shard in turn: a map (a descriptor and a mapping) per shard ever read
    # would pass the process's limits on a large dataset. Past MAX_MAPS the least recent is dropped.
    import os

    from trainer.tokens import reader

    monkeypatch.setattr(reader, "MAX_MAPS", 2)
    shards = [[[10 * i + k for k in range(5)]] for i in range(6)]
    stream = write_dataset(f"file://{tmp_path}/data", shards)
    ds = TokenDataset(f"file://{tmp_path}/data")

    def open_shards() -> int:
        paths = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        return sum(p.startswith(str(tmp_path)) and p.endswith(".tokens") for p in paths)  # this dataset's

    for _ in range(3):
        for start in range(0, len(stream) - 3, 4):  # across every shard, windows straddling two
            assert ds.read(start, 3).tolist() == stream[start:start + 3].tolist()
            assert len(ds._maps) <= 2 and open_shards() <= 2
