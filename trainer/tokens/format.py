"""The tokenized-dataset format: what `undying data prepare` writes and `TokenDataset` reads.

A prepared dataset lives under one fsspec URL `OUT`:

    OUT/shard-NNNNNN.tokens   flat little-endian token ids, uint16 when the vocabulary has at
                              most 65536 ids, else uint32 (the manifest's `dtype`)
    OUT/shard-NNNNNN.docs     little-endian uint64: the exclusive end offset, in tokens within
                              the shard, of each document; the documents of a shard are
                              [0, e0), [e0, e1), ... and the last end is the shard's length
    OUT/manifest.json         `TokenManifest`: the dtype, the tokenizer (vocabulary size, EOS id,
                              SHA-256 of its tokenizer.json), the inputs in the order given and
                              every shard with its counts and checksums

The global token stream is the shards' tokens concatenated in manifest order; every
document ends with the EOS id. The manifest is written last, by exclusive create, so its
presence means every shard it names is complete: a reader trusts nothing without it.

Protocol: the writer (`orchestrator/cli/data/`) calls `encode_shard` for each shard and
writes both files, then builds a `TokenManifest` from the shards' `ShardEntry`s and
creates `manifest.json` with `manifest_bytes`; a reader calls `parse_manifest` on those
bytes (`TokenDataset` does) and trusts the counts it returns.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FORMAT_NAME = "undying-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENS_SUFFIX, DOCS_SUFFIX = ".tokens", ".docs"
DOCS_DTYPE = np.dtype("<u8")
# Ids 0..65535 fit in two bytes: half the storage and read bandwidth of uint32.
UINT16_MAX_VOCAB = 65536
_SHARD_NAME = re.compile(r"^shard-\d{6,}$")


class TokenFormatError(ValueError):
    """A file of a prepared dataset is not what the format says; the message names the file."""


class NoManifest(FileNotFoundError):
    """The URL holds no committed dataset (no manifest.json)."""


def shard_name(index: int) -> str:
    """The base name of shard `index`: its files are `<name>.tokens` and `<name>.docs`."""
    return f"shard-{index:06d}"


def dtype_for_vocab(vocab_size: int) -> Literal["uint16", "uint32"]:
    if vocab_size <= 0 or vocab_size > 2**32:
        raise ValueError(f"vocabulary size {vocab_size} cannot be stored as uint16 or uint32 ids")
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def numpy_dtype(name: str) -> np.dtype:
    """The on-disk (little-endian) numpy dtype of a manifest's `dtype`."""
    return np.dtype({"uint16": "<u2", "uint32": "<u4"}[name])


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class ShardEntry(BaseModel):
    """One shard of the manifest: `name` without suffix, its counts and both files' SHA-256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    n_tokens: int = Field(ge=0)
    n_documents: int = Field(ge=0)
    tokens_sha256: str
    docs_sha256: str

    @model_validator(mode="after")
    def _check(self) -> ShardEntry:
        if not _SHARD_NAME.match(self.name):
            raise ValueError(f"shard name {self.name!r} is not shard-NNNNNN")
        if self.n_documents == 0 and self.n_tokens:
            raise ValueError(f"shard {self.name} has {self.n_tokens} tokens but no document")
        return self


class TokenManifest(BaseModel):
    """`OUT/manifest.json`: everything a reader needs, and the proof that the shards are complete."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["undying-tokens"] = FORMAT_NAME
    version: int = FORMAT_VERSION
    dtype: Literal["uint16", "uint32"]
    vocab_size: int = Field(gt=0)
    eos_id: int = Field(ge=0)
    tokenizer_sha256: str
    tokenizer: str  # where the tokenizer came from, for people; the hash is what identifies it
    text_field: str
    # How `undying data prepare` encoded each document (False in manifests written before they were recorded).
    add_special_tokens: bool = False  # the tokenizer's post-processor ran (a Llama tokenizer's BOS first)
    parse_special_tokens: bool = False  # special tokens written in a document became their ids
    inputs: list[str]
    n_tokens: int = Field(ge=0)
    n_documents: int = Field(ge=0)
    shards: list[ShardEntry]

    @model_validator(mode="after")
    def _check(self) -> TokenManifest:
        if self.version != FORMAT_VERSION:
            raise ValueError(f"version {self.version} is not supported (this release reads version {FORMAT_VERSION})")
        if self.dtype != dtype_for_vocab(self.vocab_size):
            raise ValueError(f"dtype {self.dtype} does not match vocab_size {self.vocab_size}")
        if self.eos_id >= self.vocab_size:
            raise ValueError(f"eos_id {self.eos_id} is outside the vocabulary (vocab_size {self.vocab_size})")
        if sum(s.n_tokens for s in self.shards) != self.n_tokens:
            raise ValueError(f"n_tokens {self.n_tokens} is not the sum of the shards' token counts")
        if sum(s.n_documents for s in self.shards) != self.n_documents:
            raise ValueError(f"n_documents {self.n_documents} is not the sum of the shards' document counts")
        if len({s.name for s in self.shards}) != len(self.shards):
            raise ValueError("two shards share a name")
        return self


def manifest_bytes(manifest: TokenManifest) -> bytes:
    """The manifest as written: stable key order and no timestamp, so the same dataset
    always gives the same bytes (a retried exclusive create recognises its own write)."""
    return (json.dumps(manifest.model_dump(mode="json"), indent=1) + "\n").encode()


def parse_manifest(data: bytes, where: str) -> TokenManifest:
    """The manifest in `data`, read from `where`; TokenFormatError naming `where` and the problem."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenFormatError(f"{where}: not valid JSON ({err}); the file is damaged, "
                               "prepare the data again") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise TokenFormatError(f"{where}: format is {found!r}, not {FORMAT_NAME!r}; "
                               "this is not a dataset written by `undying data prepare`")
    if raw.get("version") != FORMAT_VERSION:
        raise TokenFormatError(f"{where}: format version {raw.get('version')!r} is not supported "
                               f"(this release reads version {FORMAT_VERSION})")
    try:
        return TokenManifest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "manifest"
        raise TokenFormatError(f"{where}: {field}: {first['msg']}") from None


def encode_shard(tokens: np.ndarray, doc_ends: np.ndarray, dtype: str) -> tuple[bytes, bytes]:
    """The `.tokens` and `.docs` bytes of one shard; `doc_ends` are exclusive token end offsets."""
    tokens = np.asarray(tokens)
    ends = np.asarray(doc_ends, dtype=np.int64)
    assert ends.size == 0 or (ends[-1] == tokens.size and bool(np.all(np.diff(ends) >= 0))), "bad document ends"
    assert ends.size or not tokens.size, "tokens without a document"
    wide = numpy_dtype(dtype)
    assert not tokens.size or int(tokens.max()) <= np.iinfo(wide).max, "token id too large for the dtype"
    return tokens.astype(wide, copy=False).tobytes(), ends.astype(DOCS_DTYPE).tobytes()


def shard_entry(index: int, tokens_bytes: bytes, docs_bytes: bytes, itemsize: int) -> ShardEntry:
    """The manifest entry of shard `index` from the two files' bytes as written."""
    return ShardEntry(name=shard_name(index), n_tokens=len(tokens_bytes) // itemsize,
                      n_documents=len(docs_bytes) // DOCS_DTYPE.itemsize,
                      tokens_sha256=sha256_hex(tokens_bytes), docs_sha256=sha256_hex(docs_bytes))
