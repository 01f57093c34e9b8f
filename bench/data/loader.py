"""Streaming-loader throughput per rank, file:// and s3://, and the data wait of a training loop.

Protocol: `main` calls `measure_loader(work, server)` once (server: a SeaweedFS S3 server, or
None to skip s3://). It writes one prepared dataset (random ids, uint16) to each backend, then:
  * reads: one rank's cursor (dp rank 0 of 4) serves `STEPS` consecutive steps of the tiny
    model's training batch with prefetch off (`prefetch_steps` is 1 and every step is read
    cold, as a restore would): windows/s and tokens/s one rank can read;
  * training: the engine trains the tiny model one rank of dp 4 would (its share of the batch)
    for `TRAIN_STEPS` steps with the default prefetch, and reports the step time, the tokens per
    second it consumes, and the data wait per step (`StepResult.data_wait_s`) as a fraction of
    the step time (target: under 1% at default settings, s3:// included).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

STEPS, TRAIN_STEPS, WARMUP = 60, 40, 5
SEQ, GLOBAL_BATCH, MICRO, DP = 256, 32, 4, 4
VOCAB = 256  # the tiny preset's vocabulary: its step is short, so a data wait shows


def write_dataset(url: str, options: dict, n_tokens: int) -> None:
    """A prepared dataset of random ids at `url` (tests/_tokens.py writes the on-disk format);
    one document per shard of 4M tokens."""
    from tests._tokens import write_token_dataset

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=n_tokens, dtype=np.uint16)
    write_token_dataset(url, tokens, VOCAB, shard_tokens=4_000_000, doc_tokens=4_000_000, storage_options=options)


def read_rate(url: str, options: dict) -> dict:
    from trainer.config import DataConfig
    from trainer.data import make_cursor

    cursor = make_cursor(DataConfig(source="tokens", path=url, storage_options=options, seq_len=SEQ,
                                    prefetch_steps=1), VOCAB)
    started = time.perf_counter()
    for step in range(STEPS):
        cursor._load((step, GLOBAL_BATCH, MICRO, 0, DP))  # cold reads, no prefetch
    seconds = time.perf_counter() - started
    cursor.close()
    windows = STEPS * GLOBAL_BATCH // DP
    return {"windows_per_s": windows / seconds, "tokens_per_s": windows * (SEQ + 1) / seconds}


def train_rate(url: str, options: dict) -> dict:
    """The tiny model as one rank of dp 4 trains it: a single-process engine on that rank's share."""
    from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from trainer.engine import Engine

    data = DataConfig(source="tokens", path=url, storage_options=options, seq_len=SEQ)
    train = TrainConfig(steps=TRAIN_STEPS + WARMUP, global_batch=GLOBAL_BATCH // DP, micro_batch=MICRO)
    engine = Engine(ModelConfig(preset="tiny", max_seq_len=SEQ), data, train, ParallelConfig(),
                    rank=0, world_size=1)
    results = [engine.train_step() for _ in range(TRAIN_STEPS + WARMUP)][WARMUP:]
    engine.data.close()
    step_s = statistics.median(r.step_s for r in results)
    wait = sum(r.data_wait_s for r in results) / sum(r.step_s for r in results)
    return {"step_s": step_s, "consumed_tokens_per_s": GLOBAL_BATCH // DP * SEQ / step_s, "wait_fraction": wait,
            "wait_ms_median": statistics.median(r.data_wait_s for r in results) * 1e3}


def measure_loader(work: Path, server, n_tokens: int) -> dict:
    import uuid

    backends = {"file": (f"file://{work}/tokens", {})}
    if server is not None:
        from tests.s3._seaweed import BUCKET

        backends["s3"] = (f"s3://{BUCKET}/{uuid.uuid4().hex}/tokens", server.storage_options)
    out = {}
    for name, (url, options) in backends.items():
        write_dataset(url, options, n_tokens)
        out[name] = {**read_rate(url, options), **train_rate(url, options)}
    return out
