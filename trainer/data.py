"""The global data cursor: sample i of global step s is a pure function of (seed, s, i).

A global step consumes `global_batch` samples, indexed 0..global_batch-1. A data-parallel
rank owns one contiguous block of those indices and cuts it into microbatches, so the
union over ranks is the same global batch whatever the layout (dp degree, microbatch size).
Nothing is stateful: the "cursor" is just the step number, which the engine checkpoints. A
run resumed in another layout therefore neither skips nor repeats a sample (docs/design.md
invariant 4).

Sources:
  synthetic  a noisy affine Markov chain over the vocabulary, x[t+1] = (a * x[t] + c) mod V
             with probability 1 - SYNTHETIC_NOISE and a uniform random token otherwise. The
             model can learn it, so the loss visibly falls from ln(V) towards the noise
             floor; sample lengths are drawn in [min_len_fraction * seq_len, seq_len] so
             microbatches are ragged and padding is exercised.
  text       a UTF-8 file read once (fsspec URL or path), one token per byte (vocab >= 256);
             each sample is a window of seq_len + 1 bytes at an offset hashed from (seed, s, i).
  tokens     prepared token datasets (`undying data prepare`), streamed by trainer/tokens/loader.py:
             windows drawn without replacement within an epoch, a mixture of datasets by weight.

`make_cursor` picks the cursor for a DataConfig. Every cursor makes or reads the next
`prefetch_steps` steps ahead on a background thread (trainer/prefetch.py), counts the samples it
served (`consumed`, a trainer.batch.SampleDigest) and times each call's wait (`last_wait_s`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import zlib
from collections.abc import Callable, Iterable

import fsspec
import numpy as np
import torch

from trainer.batch import Batch, SampleDigest, collate, microbatches_per_rank, owned_indices
from trainer.config import DataConfig
from trainer.prefetch import ReadAheadCursor
from trainer.seeding import derive_seed, generator

__all__ = ["Batch", "DataCursor", "collate", "make_cursor", "microbatches_per_rank", "read_text_bytes"]

SYNTHETIC_NOISE = 0.1
BYTE_VOCAB = 256


def _affine_powers(mul: int, add: int, vocab_size: int, n: int) -> np.ndarray:
    """[2, n] int64: row 0 a^k mod V, row 1 c (a^(k-1) + ... + 1) mod V, for k = 0..n-1 (the map
    x -> (a x + c) mod V applied k times is x -> (row0[k] x + row1[k]) mod V). Entries stay below V,
    so a product with a token (< V) fits int64 for any vocabulary."""
    out = [(1, 0)]
    for _ in range(n - 1):
        power, offset = out[-1]
        out.append(((power * mul) % vocab_size, (offset * mul + add) % vocab_size))
    return np.ascontiguousarray(np.array(out, dtype=np.int64).T)


# Every rank holds the text source whole (and the driver reads it once to check it): past this, a
# corpus is for `undying data prepare` (memory-mapped, read by window), not for `source: text`.
MAX_TEXT_BYTES = 256 << 20


class TextTooLarge(ValueError):
    """A `source: text` file larger than MAX_TEXT_BYTES."""


class NotUtf8Text(ValueError):
    """A `source: text` file whose bytes do not decode as UTF-8."""


def read_text_bytes(path: str, storage_options: dict | None = None) -> torch.Tensor:
    """The bytes of a UTF-8 text file as a uint8 tensor (read once, through fsspec); TextTooLarge
    when it exceeds MAX_TEXT_BYTES (before anything is read where the store tells its size; after
    one byte more than that where it does not), NotUtf8Text when it is not UTF-8."""
    fs, where = fsspec.core.url_to_fs(path, **(storage_options or {}))
    size = fs.size(where)
    if size is not None and size > MAX_TEXT_BYTES:
        raise TextTooLarge(_too_large(path, f"{size / 2**20:.0f} MiB"))
    with fs.open(where, "rb") as handle:  # to its end, or one byte past the limit: a streamed file's read(n)
        chunks, held = [], 0  # returns what has arrived, not n bytes
        while held <= MAX_TEXT_BYTES and (chunk := handle.read(MAX_TEXT_BYTES + 1 - held)):
            chunks.append(chunk)
            held += len(chunk)
    raw = b"".join(chunks)
    if len(raw) > MAX_TEXT_BYTES:
        raise TextTooLarge(_too_large(path, f"over {MAX_TEXT_BYTES >> 20} MiB"))
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotUtf8Text(f"data.path={path!r} is not UTF-8 text ({err})") from err
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _too_large(path: str, held: str) -> str:
    return (f"{path} holds {held}, more than source 'text' takes ({MAX_TEXT_BYTES >> 20} MiB: every rank holds it "
            "whole); prepare it with `undying data prepare` and train with data.source: tokens")


class DataCursor(ReadAheadCursor):
    """Deterministic samples of the synthetic or text source. `sample` is safe to call from any
    thread (no state: the prefetch thread calls it); `microbatches` (trainer.prefetch.ReadAheadCursor)
    also counts what it served, for the training thread only.

    Every rank builds its own cursor from the same DataConfig and calls `microbatches` once
    per step with its place in the layout; no communication is needed.
    """

    def __init__(self, cfg: DataConfig, vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.consumed = SampleDigest()  # the samples this cursor served (trainer.batch)
        self.last_wait_s = 0.0  # how long the last `microbatches` call waited for its batches
        self.closed = threading.Event()
        self.prefetch_steps = cfg.prefetch_steps
        self._text: torch.Tensor | None = None
        if cfg.source == "text":
            if vocab_size < BYTE_VOCAB:
                raise ValueError(
                    f"data.source='text' uses one token per byte and needs model.vocab_size >= "
                    f"{BYTE_VOCAB}, got {vocab_size}"
                )
            self._text = read_text_bytes(cfg.path, cfg.storage_options)
            self._text_crc = zlib.crc32(memoryview(self._text.numpy()))
            if len(self._text) < cfg.seq_len + 1:
                raise ValueError(
                    f"data.path={cfg.path!r} has {len(self._text)} bytes, fewer than "
                    f"data.seq_len + 1 = {cfg.seq_len + 1}: use a longer file or a shorter seq_len"
                )
        else:
            if vocab_size < 2:
                raise ValueError(f"synthetic data needs model.vocab_size >= 2, got {vocab_size}")
            rule = generator(cfg.seed, "synthetic-rule")
            # An odd multiplier makes the map a permutation when V is a power of two, so the
            # chain wanders over the whole vocabulary instead of collapsing into a short cycle.
            self._mul = int(torch.randint(0, vocab_size // 2, (1,), generator=rule)) * 2 + 1
            self._add = int(torch.randint(1, vocab_size, (1,), generator=rule))
            self._powers = _affine_powers(self._mul, self._add, vocab_size, cfg.seq_len + 1)

    def identity(self) -> dict:
        """What decides the tokens of each (step, index) besides data.seed: a checkpoint carries it,
        and a restore under another is refused (trainer.engine_state)."""
        if self._text is not None:
            return {"source": "text", "seq_len": self.cfg.seq_len, "bytes": len(self._text), "crc32": self._text_crc}
        return {"source": "synthetic", "seq_len": self.cfg.seq_len, "min_len_fraction": self.cfg.min_len_fraction}

    def sample(self, step: int, index: int) -> torch.Tensor:
        """Sample `index` of global step `step`: a 1-D int64 tensor of at most seq_len + 1 tokens."""
        if step < 0 or index < 0:
            raise ValueError(f"step and index must be >= 0, got step={step}, index={index}")
        if self._text is not None:
            span = self.cfg.seq_len + 1
            offset = derive_seed(self.cfg.seed, step, index) % (len(self._text) - span + 1)
            return self._text[offset : offset + span].long()
        return self._synthetic(generator(self.cfg.seed, step, index))

    def _synthetic(self, gen: torch.Generator) -> torch.Tensor:
        """The chain x[t+1] = f(x[t]) = (a x[t] + c) mod V, restarted at a random token where the
        noise hits (and at t = 0). Without a Python loop: token t is f applied k times to the last
        restart s <= t (k = t - s), and f^k(x) = (a^k x + c (a^(k-1) + ... + 1)) mod V, whose two
        coefficients `_powers` holds for every k. Same draws, same tokens as the loop it replaces."""
        seq_len = self.cfg.seq_len
        shortest = max(1, math.ceil(self.cfg.min_len_fraction * seq_len))
        n_tokens = int(torch.randint(shortest, seq_len + 1, (1,), generator=gen)) + 1
        restart = torch.rand(n_tokens, generator=gen).numpy() < SYNTHETIC_NOISE
        random_tokens = torch.randint(0, self.vocab_size, (n_tokens,), generator=gen).numpy()
        # The arithmetic in numpy: the same int64 values, at a fraction of torch's per-op cost
        # on arrays this small (this runs on the training thread, every step).
        restart[0] = True
        positions = np.arange(n_tokens)
        last_restart = np.maximum.accumulate(np.where(restart, positions, 0))
        mul, add = self._powers[:, positions - last_restart]
        return torch.from_numpy((mul * random_tokens[last_restart] + add) % self.vocab_size)

    def sample_ids(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
        """The global sample indices of `step` that data-parallel rank `dp_rank` owns: a contiguous
        block (trainer.batch.owned_indices); the step argument keeps call sites explicit about time."""
        return owned_indices(global_batch, dp_rank, dp_size)

    def sample_keys(self, step: int, global_batch: int, indices: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """The ids of samples `indices` (default: all) of `step`, as the digests count them: (0, global index)."""
        indices = range(global_batch) if indices is None else indices
        return [(0, step * global_batch + i) for i in indices]

    def _load(self, key: tuple) -> tuple[list[Batch], list[tuple[int, int]]]:
        """(microbatches, sample ids) of `key` = (step, global_batch, micro_batch, dp_rank, dp_size): this
        rank's samples in index order, cut into microbatches; a pure function (the prefetch thread calls it)."""
        step, global_batch, micro_batch, dp_rank, dp_size = key
        count = microbatches_per_rank(global_batch, micro_batch, dp_size)
        owned = self.sample_ids(step, global_batch, dp_rank, dp_size)
        samples = [self.sample(step, i) for i in owned]
        batches = [collate(samples[k * micro_batch : (k + 1) * micro_batch]) for k in range(count)]
        return batches, self.sample_keys(step, global_batch, owned)


def make_cursor(cfg: DataConfig, vocab_size: int, read_retry=None):
    """The data cursor of `cfg`: `DataCursor` for synthetic and text, the streaming `TokenCursor`
    for prepared datasets (trainer/tokens/loader.py). Both serve `microbatches(...)` the same way.
    `read_retry`: how the datasets' remote reads are retried (trainer.tokens.reader)."""
    if cfg.source != "tokens":
        return DataCursor(cfg, vocab_size)
    from trainer.tokens.loader import TokenCursor
    from trainer.tokens.reader import TokenDataset

    closed = threading.Event()  # the cursor's `close` sets it
    if read_retry is not None:  # a read retried on a failing store gives up once the cursor is closed
        read_retry = dataclasses.replace(read_retry, interrupt=functools.partial(_stop_once, closed,
                                                                                 read_retry.interrupt))
    parts, fields = zip(*cfg.token_parts(), strict=True)
    datasets = [TokenDataset(part.path, cfg.storage_options, retry=read_retry) for part in parts]
    for field, part, ds in zip(fields, parts, datasets, strict=True):
        if ds.vocab_size > vocab_size:
            raise ValueError(f"{field}={part.path!r} was tokenized with a vocabulary of {ds.vocab_size}, larger "
                             f"than model.vocab_size = {vocab_size}: use the model's tokenizer or a larger vocab_size")
    return TokenCursor(datasets, [p.weight for p in parts], fields, cfg.seq_len, cfg.seed, cfg.prefetch_steps,
                       closed=closed)


def data_identity(cfg: DataConfig, vocab_size: int) -> dict:
    """The data's identity (the cursor's `identity()`, which a checkpoint carries), computed where no
    rank runs: the driver, which refuses a resume under other data before any rank starts. Reads what
    the cursor reads to build itself: a text source's file, the prepared datasets' manifests."""
    cursor = make_cursor(cfg, vocab_size)
    try:
        return cursor.identity()
    finally:
        close = getattr(cursor, "close", None)
        if close is not None:
            close()


class CursorClosed(RuntimeError):
    """A data read was given up: its cursor was closed (the rank dropped the engine) while it waited."""


def _stop_once(closed: threading.Event, interrupt: Callable[[], None] | None) -> None:
    if closed.is_set():
        raise CursorClosed("the data cursor was closed while a read waited out the store's failures")
    if interrupt is not None:
        interrupt()
