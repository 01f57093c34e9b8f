"""A small generated corpus and a tokenizer trained on it, for the `undying data prepare` tests.

`write_corpus(dir)` writes .txt, .jsonl and .parquet inputs (and, with `hf=True`, a
`datasets` save_to_disk directory) and returns the input paths in stream order with the
documents each holds; `expected_stream` is the single-process reference: each document
encoded as the command's defaults say (through the tokenizer's post-processor, which the
generated tokenizer does not have; special tokens in the text as its characters), then EOS, in
input order.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

EOS = "</s>"


def documents(n: int, seed: int = 0) -> list[str]:
    """Varied documents: unicode, quotes, newlines, an empty one, a few long ones."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "naïve", "café", "東京", "emoji 🙂", "\"quoted\"", "tab\there",
             "line\nbreak", "x", "the", "of", "and"]
    docs = []
    for i in range(n):
        length = rng.choice([0, 1, 3, 8, 20, 60]) if i % 17 else 200
        docs.append(" ".join(rng.choice(words) for _ in range(length)))
    return docs


def train_tokenizer(path: Path, docs: list[str], vocab_size: int = 400, eos: str = EOS) -> Path:
    """A byte-level BPE tokenizer trained on `docs`, saved as tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def write_corpus(root: Path, docs: list[str], hf: bool = False) -> list[tuple[Path, list[str]]]:
    """Inputs holding `docs` in order: two .txt files, a .jsonl (with a blank line), a
    .parquet of several row groups and, with `hf`, a datasets save_to_disk directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    n = len(docs)
    cuts = [1, 2, n // 2, (3 * n) // 4 if hf else n, n]
    parts = [docs[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    inputs = []
    for i in range(2):
        path = root / f"doc{i}.txt"
        path.write_bytes(parts[i][0].encode())
        inputs.append((path, parts[i]))
    jsonl = root / "part.jsonl"
    lines = [json.dumps({"id": k, "text": d}, ensure_ascii=k % 2 == 0) for k, d in enumerate(parts[2])]
    lines.insert(len(lines) // 2, "   ")  # a blank line is no record
    jsonl.write_text("\n".join(lines) + "\n")
    inputs.append((jsonl, parts[2]))
    parquet = root / "part.parquet"
    pq.write_table(pa.table({"text": parts[3], "n": list(range(len(parts[3])))}), parquet, row_group_size=7)
    inputs.append((parquet, parts[3]))
    if hf:
        import datasets

        directory = root / "hf"
        datasets.Dataset.from_dict({"text": parts[4]}).save_to_disk(str(directory), num_shards=2)
        inputs.append((directory, parts[4]))
    return inputs


def expected_stream(tokenizer_path: Path, docs: list[str], eos: str = EOS) -> tuple[np.ndarray, np.ndarray]:
    """The reference token stream and document ends, one document at a time in one process."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.encode_special_tokens = True
    eos_id = tokenizer.token_to_id(eos)
    ids, ends = [], []
    for doc in filter(None, docs):  # an empty text is no document
        ids += tokenizer.encode(doc).ids + [eos_id]
        ends.append(len(ids))
    return np.array(ids, dtype=np.int64), np.array(ends, dtype=np.int64)
