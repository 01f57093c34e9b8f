"""Prepared token datasets written directly in the on-disk format (no tokenizer, no Ray), for the
loader, eval and exactly-once tests and the data bench: the token stream is given, so
expectations are exact."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np

from trainer.tokens.format import (
    DOCS_SUFFIX,
    MANIFEST_NAME,
    TOKENS_SUFFIX,
    TokenManifest,
    dtype_for_vocab,
    encode_shard,
    manifest_bytes,
    shard_entry,
    shard_name,
)


def write_token_dataset(out: Path | str, tokens: np.ndarray, vocab_size: int, shard_tokens: int = 1000,
                        doc_tokens: int = 50, eos_id: int = 0, tokenizer_sha256: str = "0" * 64,
                        storage_options: dict | None = None, tokenizer: str = "generated",
                        inputs: list[str] | None = None) -> Path | str:
    """Write `tokens` as shards of `shard_tokens` tokens, documents of `doc_tokens`, at `out` (a local
    path or any fsspec URL, with `storage_options`; `tokenizer`: where its manifest says the
    tokenizer came from; `inputs`: the text it says it was prepared from, by default its own); returns `out`."""
    fs, root = fsspec.core.url_to_fs(str(out), **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    entries = []
    for index, start in enumerate(range(0, len(tokens), shard_tokens)):
        part = tokens[start:start + shard_tokens]
        ends = np.append(np.arange(doc_tokens, len(part), doc_tokens), len(part))
        tokens_bytes, docs_bytes = encode_shard(part, ends, dtype)
        fs.pipe_file(f"{root}/{shard_name(index)}{TOKENS_SUFFIX}", tokens_bytes)
        fs.pipe_file(f"{root}/{shard_name(index)}{DOCS_SUFFIX}", docs_bytes)
        entries.append(shard_entry(index, tokens_bytes, docs_bytes, np.dtype(dtype).itemsize))
    manifest = TokenManifest(dtype=dtype, vocab_size=vocab_size, eos_id=eos_id, tokenizer_sha256=tokenizer_sha256,
                             tokenizer=tokenizer, text_field="text", inputs=inputs or [f"generated:{out}"],
                             n_tokens=len(tokens),
                             n_documents=sum(e.n_documents for e in entries), shards=entries)
    fs.pipe_file(f"{root}/{MANIFEST_NAME}", manifest_bytes(manifest))
    return out


def counting_tokens(n: int, vocab_size: int) -> np.ndarray:
    """Token t is t mod vocab_size: a window's first token tells where it starts."""
    return (np.arange(n, dtype=np.int64) % vocab_size).astype(np.int64)
