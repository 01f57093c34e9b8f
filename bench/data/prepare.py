"""Tokenizing throughput: `undying data prepare` on Ray Data against one-process `tokenizers` loops.

Protocol: `main` calls `measure_prepare(work, mib, ...)` once; it makes the .jsonl corpus and the
tokenizer, then runs the ways below over them, each producing the same token stream (checked):
  * loop         a single-process loop, `tokenizer.encode(doc, add_special_tokens=False)` per
                 document, EOS appended, the ids collected into one uint16 array: how a script
                 tokenizes (the issue's anchor);
  * batch        the same in one process with `encode_batch` (Rust threads on every core), and
                 with `encode_batch_fast` (ids only, no character offsets: what ours runs in
                 each task): the strongest single-process ways, to show where a speed-up comes from;
  * ours         `undying data prepare` as a user runs it (a subprocess: embedded Ray start-up,
                 Ray Data tasks, shard writes, manifest), wall time end to end, and the same
                 with Ray's start-up taken out (its "workers on" line to the end).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "an",
    "be", "this", "are", "which", "or", "had", "not", "but", "river", "mountain", "engine", "signal", "garden",
    "library", "window", "market", "winter", "orbit", "copper", "lantern", "harbor", "quickly", "slowly",
    "brightly", "naive", "cafe", "tokyo", "ratio", "vector", "matrix",
)


def make_corpus(out: Path, mib: int, files: int = 8, seed: int = 0) -> list[Path]:
    """`files` .jsonl files of about `mib` MiB of text in all, documents of 20 to 400 words."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    paths, per_file = [], mib * 2**20 // files
    for i in range(files):
        path = out / f"part-{i:02d}.jsonl"
        size = 0
        with path.open("w") as f:
            while size < per_file:
                line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(path)
    return paths


def train_tokenizer(paths: list[Path], out: Path, vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = (json.loads(line)["text"] for line in paths[0].open())
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"]))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def _documents(paths: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for path in paths for line in path.open()]


def loop(paths: list[Path], tokenizer_path: Path, batch: str | None) -> tuple[float, np.ndarray]:
    """One process: per-document `encode` (batch None), or `encode_batch` / `encode_batch_fast`."""
    from tokenizers import Tokenizer

    started = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id("</s>")
    docs = _documents(paths)
    encoded = getattr(tok, batch)(docs, add_special_tokens=False) if batch else \
        [tok.encode(d, add_special_tokens=False) for d in docs]
    ids = np.concatenate([np.array([*e.ids, eos], dtype=np.uint16) for e in encoded])
    return time.perf_counter() - started, ids


def ours(paths: list[Path], tokenizer_path: Path, out: Path, address: str | None = None
         ) -> tuple[float, float, np.ndarray]:
    """(wall s, wall s from the workers being up to the end, the stream) of `undying data prepare`
    in a subprocess; the workers are up at its "units to run on" line."""
    from trainer.tokens.reader import TokenDataset

    cmd = [str(Path(sys.executable).parent / "undying"), "data", "prepare", *map(str, paths),
           "--tokenizer", str(tokenizer_path), "--out", f"file://{out}", *(["--address", address] if address else [])]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers_up = None
    for line in proc.stdout:
        if workers_up is None and "units to run on" in line:
            workers_up = time.perf_counter()
    if proc.wait() != 0:
        raise RuntimeError(f"undying data prepare failed (exit {proc.returncode})")
    ended = time.perf_counter()
    ds = TokenDataset(f"file://{out}")
    return ended - started, ended - (workers_up or started), ds.read(0, len(ds))


def measure_prepare(work: Path, mib: int, start_cluster=None, rounds: int = 3) -> dict:
    """The ways on one corpus; with `start_cluster` (a context manager yielding the address of a Ray
    cluster of this machine's cores, started only for that run so it idles beside nothing else)
    `undying data prepare --address` too, as a user of a standing cluster runs it.

    The loop and ours run `rounds` times, alternately, and each is reported by its median: a shared
    2-core host drifts by 10-40% over minutes, so one run of each compares two moments of the host
    as much as two programs; alternating keeps each round's pair side by side, and each round's own
    ratios (`rounds`) show the spread. The two batch rows, which explain rather than decide, run once."""
    paths = make_corpus(work / "corpus", mib)
    tokenizer = train_tokenizer(paths, work / "tokenizer")
    batch_s, batched = loop(paths, tokenizer, batch="encode_batch")
    fast_s, fast = loop(paths, tokenizer, batch="encode_batch_fast")
    same, reference, per_round = bool(np.array_equal(batched, fast)), batched, []
    del fast
    for i in range(rounds):
        row = {}
        row["loop_s"], stream = loop(paths, tokenizer, batch=None)
        same = same and bool(np.array_equal(reference, stream))
        row["ours_s"], row["ours_after_startup_s"], stream = ours(paths, tokenizer, work / f"prepared-{i}")
        same = same and bool(np.array_equal(reference, stream))
        if start_cluster is not None:
            with start_cluster() as address:
                row["ours_cluster_s"], _, stream = ours(paths, tokenizer, work / f"prepared-cluster-{i}", address)
            same = same and bool(np.array_equal(reference, stream))
        per_round.append(row)
        print(f"round {i + 1}/{rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return {"corpus_mib": sum(p.stat().st_size for p in paths) / 2**20, "tokens": int(len(reference)),
            "documents": sum(1 for p in paths for _ in p.open()), "batch_s": batch_s, "fast_s": fast_s,
            **medians(per_round), "rounds": per_round, "same_stream": same}


def medians(per_round: list[dict]) -> dict:
    """Each timing's median over the rounds (the rounds themselves are reported beside them)."""
    return {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
