"""Thread vs process background writer: which one slows a training loop less, and which finishes sooner.

Run on one rank (rank 0 of the worker group, with its shard of the bench state) while the
other ranks wait in a barrier (idle: measured, gloo's barrier does not spin). The
"training" is a loop of forward/backward/AdamW steps of a small MLP on one intra-op
thread: many small ops, so the interpreter holds the GIL for much of each step, as in a
real training loop, and a writer that wants the GIL too shows up as slower steps.

Trials are windows of training of a fixed length W (1.5 x the slowest warm-up write, 1 s to
15 s). Three conditions, rotated in every repeat so that load from other processes on
a shared machine falls on all of them alike:
  none     training only: its median seconds per step is the baseline, and its own spread
           ("lost" of a save-free window) is the noise floor of this measurement;
  thread   `ckpt.writer.ShardWriter.save` (async) at the start of the window;
  process  `ckpt.process_writer.ProcessShardWriter.save` (checkpoint.writer: process) at the start
           of the window.
A window with a save lasts until W has passed and the shard is durable (its receipt came).
Per trial: blocking = the save call; write = save start -> receipt; lost = window length -
steps x baseline step (the training time the save cost, blocking included).
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

from ckpt.process_writer import ProcessShardWriter
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from trainer.state_slices import TensorSlice

MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 15.0
CONDITIONS = ("none", "thread", "process")


class Trainer:
    """A small MLP trained on random data: the stand-in for the rank's training thread."""

    def __init__(self, width: int = 256, batch: int = 32, depth: int = 6):
        torch.manual_seed(1)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width)

    def step(self) -> None:
        self.model(self.x).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Done:
    """Set from the writer's callback thread: when the shard became durable."""

    def __init__(self):
        self.event = threading.Event()
        self.when = 0.0
        self.errors: list[str] = []

    def mark(self) -> None:
        self.when = time.perf_counter()
        self.event.set()

    def on_receipt(self, receipt, extra) -> None:
        self.mark()

    def on_error(self, step, err) -> None:
        self.errors.append(f"step {step}: {err}")
        self.mark()


def _window(trainer: Trainer, writer, slices: list[TensorSlice], step: int, done: Done, window_s: float) -> dict:
    done.event.clear()
    start = time.perf_counter()
    blocking = writer.save(step, slices, {}) if writer is not None else 0.0
    steps = 0
    while True:
        trainer.step()
        steps += 1
        if time.perf_counter() - start >= window_s and (writer is None or done.event.is_set()):
            break
    elapsed = time.perf_counter() - start
    if writer is not None:
        writer.wait()  # the writer (thread or process) and its staging buffer stay for the next window
    return {"blocking": blocking, "write": done.when - start if writer is not None else 0.0,
            "steps": steps, "elapsed": elapsed}


def measure(url: str, options: dict, rank: int, slices: list[TensorSlice], repeats: int) -> dict:
    """Interleaved trials of the three conditions on `url` (one step directory per save, deleted at the end)."""
    torch.set_num_threads(1)
    done = Done()
    storage = Storage(url, options)
    writers = {"none": None,
               "thread": ShardWriter(storage, rank, done.on_receipt, done.on_error, async_save=True),
               "process": ProcessShardWriter(url, options, rank, done.on_receipt, done.on_error)}
    trainer = Trainer()
    trials: dict[str, list[dict]] = {name: [] for name in CONDITIONS}
    step = 1
    try:
        warm = []
        for name in ("thread", "process"):  # not counted; sizes the window
            warm.append(_window(trainer, writers[name], slices, step, done, 0.0)["write"])
            step += 1
        window_s = min(MAX_WINDOW_S, max(MIN_WINDOW_S, 1.5 * max(warm)))
        for rep in range(repeats):
            order = CONDITIONS[rep % 3:] + CONDITIONS[:rep % 3]
            for name in order:
                trials[name].append(_window(trainer, writers[name], slices, step, done, window_s))
                step += 1
    finally:
        writers["thread"].flush()
        writers["process"].flush()
        storage.remove_tree(storage.root)
    if done.errors:
        raise RuntimeError(f"background writes failed: {done.errors}")
    base = statistics.median(t["elapsed"] / t["steps"] for t in trials["none"])
    for runs in trials.values():
        for t in runs:
            t["lost"] = t["elapsed"] - t["steps"] * base
            t["slowdown"] = t["elapsed"] / t["steps"] / base
    return {"window_s": window_s, "baseline_step_s": base,
            "writers": {name: {"trials": runs, **{f"median_{k}": statistics.median(t[k] for t in runs)
                                                  for k in ("blocking", "write", "lost", "slowdown")}}
                        for name, runs in trials.items()}}
