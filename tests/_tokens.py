"""Prepared token datasets written directly in the on-disk format (no tokenizer, no Ray), for the
loader, eval and exactly-once tests: the token stream is given, so expectations are exact."""

from __future__ import annotations

from pathlib import Path

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


def write_token_dataset(out: Path, tokens: np.ndarray, vocab_size: int, shard_tokens: int = 1000,
                        doc_tokens: int = 50, eos_id: int = 0, tokenizer_sha256: str = "0" * 64) -> Path:
    """Write `tokens` as shards of `shard_tokens` tokens, documents of `doc_tokens`; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    entries = []
    for index, start in enumerate(range(0, len(tokens), shard_tokens)):
        part = tokens[start:start + shard_tokens]
        ends = np.append(np.arange(doc_tokens, len(part), doc_tokens), len(part))
        tokens_bytes, docs_bytes = encode_shard(part, ends, dtype)
        (out / f"{shard_name(index)}{TOKENS_SUFFIX}").write_bytes(tokens_bytes)
        (out / f"{shard_name(index)}{DOCS_SUFFIX}").write_bytes(docs_bytes)
        entries.append(shard_entry(index, tokens_bytes, docs_bytes, np.dtype(dtype).itemsize))
    manifest = TokenManifest(dtype=dtype, vocab_size=vocab_size, eos_id=eos_id, tokenizer_sha256=tokenizer_sha256,
                             tokenizer="generated", text_field="text", inputs=["generated"], n_tokens=len(tokens),
                             n_documents=sum(e.n_documents for e in entries), shards=entries)
    (out / MANIFEST_NAME).write_bytes(manifest_bytes(manifest))
    return out


def counting_tokens(n: int, vocab_size: int) -> np.ndarray:
    """Token t is t mod vocab_size: a window's first token tells where it starts."""
    return (np.arange(n, dtype=np.int64) % vocab_size).astype(np.int64)
