"""The alternative to ShardWriter's writer thread, for the thread-vs-process measurement: the same
shard write done by a long-lived child process that reads the staged bytes from shared memory.

Protocol (the same as `ckpt.writer.ShardWriter`, so the two are measured on equal terms):
  `save(step, slices, extra)` picks this rank's share (`ckpt.shards.slices_to_write`),
  waits for a save still in flight (one snapshot staged at most, design.md invariant 6),
  copies the share into a shared-memory staging buffer (the only blocking work), sends the
  geometry to the child and returns the blocking seconds. The child runs
  `ckpt.shards.write_slices` on views of that buffer, the very function the writer thread
  runs, and sends the receipt back; a listener thread hands it to `on_receipt`.

The staging buffer is one flat shared tensor, allocated at the first save (and again only
if a save needs more room) and sent to the child once; later saves copy into it, so they
neither allocate nor page-fault, as the thread writer's kept staging pool. The child
is started with "spawn" (a fork of a process running gloo threads is unsafe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing as mp

from ckpt.blocks import ALIGN
from ckpt.manifest import ShardReceipt
from ckpt.shards import slices_to_write, write_slices
from ckpt.storage import Storage
from trainer.state_slices import TensorSlice


def _layout(pieces: Sequence[TensorSlice]) -> tuple[list[int], int]:
    """Byte offset of each piece in the flat buffer (ALIGN-aligned, so typed views are valid) and the total."""
    offsets, total = [], 0
    for piece in pieces:
        total += -total % ALIGN
        offsets.append(total)
        total += piece.nbytes
    return offsets, total


def _view(flat: torch.Tensor, offset: int, piece: TensorSlice) -> torch.Tensor:
    return flat[offset:offset + piece.nbytes].view(piece.dtype).view(piece.lengths)


def _serve(url: str, options: dict, rank: int, jobs, done) -> None:
    """Child process: write each job's slices from the shared buffer, answer with the receipt or the error."""
    torch.set_num_threads(1)
    storage = Storage(url, options)
    done.put(("ready", "", None))
    flat = None
    while True:
        job = jobs.get()
        if job is None:
            return
        if job["buffer"] is not None:
            flat = job["buffer"]
        try:
            staged = [piece.with_tensor(_view(flat, offset, piece))
                      for piece, offset in zip(job["pieces"], job["offsets"], strict=True)]
            receipt = write_slices(storage, job["step"], rank, staged, job["blocking_s"], held=job["held"])
            done.put(("ok", receipt.model_dump_json(), job["extra"]))
        except BaseException as err:  # reported to the parent, never lost with the child
            done.put(("error", f"{type(err).__name__}: {err}", job["step"]))


class ProcessShardWriter:
    def __init__(self, url: str, options: dict, rank: int,
                 on_receipt: Callable[[ShardReceipt, dict], None],
                 on_error: Callable[[int, BaseException], None]):
        self.rank = rank
        self.on_receipt = on_receipt
        self.on_error = on_error
        self.waited = 0
        context = mp.get_context("spawn")
        self._jobs, self._done = context.Queue(), context.Queue()
        self._proc = context.Process(target=_serve, args=(url, options, rank, self._jobs, self._done),
                                     name=f"ckpt-writer-proc-r{rank}", daemon=True)
        self._proc.start()
        # Started and imported before the first save, as a long-lived helper would be.
        kind, _, _ = self._done.get(timeout=300)
        if kind != "ready":
            raise RuntimeError(f"writer process {self._proc.pid} did not start: {kind}")
        self._flat: torch.Tensor | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._listener = threading.Thread(target=self._listen, name=f"ckpt-writer-listen-r{rank}", daemon=True)
        self._listener.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def save(self, step: int, slices: Sequence[TensorSlice], extra: dict) -> float:
        started = time.perf_counter()
        if not self._idle.is_set():
            self.waited += 1
            self._idle.wait()
        held = [piece.with_tensor(None) for piece in slices]
        mine = slices_to_write(slices)
        offsets, total = _layout(mine)
        fresh = self._flat is None or self._flat.numel() < total
        if fresh:
            self._flat = torch.empty(total, dtype=torch.uint8).share_memory_()
        for piece, offset in zip(mine, offsets, strict=True):
            if piece.tensor is None:
                raise ValueError(f"{piece.name}{list(piece.offsets)}: a slice to save has no data")
            _view(self._flat, offset, piece).copy_(piece.tensor)
        blocking_s = time.perf_counter() - started
        self._idle.clear()
        self._jobs.put({"step": step, "pieces": [p.with_tensor(None) for p in mine], "offsets": offsets,
                        "held": held, "blocking_s": blocking_s, "extra": extra,
                        "buffer": self._flat if fresh else None})
        return blocking_s

    def _listen(self) -> None:
        while True:
            message = self._done.get()
            if message is None:
                return
            kind, payload, detail = message
            try:
                if kind == "ok":
                    self.on_receipt(ShardReceipt.model_validate_json(payload), detail)
                else:
                    self.on_error(detail, RuntimeError(payload))
            finally:
                self._idle.set()

    def flush(self) -> None:
        self._idle.wait()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the save in flight, then stop the child (by its PID if it does not exit)."""
        self.flush()
        self._jobs.put(None)
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._done.put(None)
        self._listener.join()
