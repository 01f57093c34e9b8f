"""Seconds of a step's work as the device ran it: the compute time the straggler detector compares
across ranks (StepResult.compute_s) and the pipeline's busy time and bubble (trainer.pipeline).

On the CPU an operation has finished when its call returns, so the host's clock times it. On CUDA
a call only queues kernels: the host's clock says when work was queued, and a rank whose GPU is
slow (throttled, a bad HBM stack, a neighbour's heat) looks as fast as the others until something
waits for it. There a mark is a CUDA event recorded on the current stream, and it is read once the
work before it has run.

Protocol: `mark()` at each point of interest, from the training thread or from autograd's thread
(DDP's communication hook runs there, on the stream the backward used); `seconds(a, b)` once both
marks are recorded, `b` after `a` on the same stream: on CUDA it waits for `b` to complete (call
it after the step's own synchronisation, such as reading the loss, to add no wait); `host_time`
puts a mark on the host's clock, anchored at a mark whose host time was taken with it.
"""

from __future__ import annotations

import time

import torch


class DeviceClock:
    def __init__(self, device: str | torch.device = "cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def opening(self) -> tuple[float | torch.cuda.Event, float]:
        """A mark and the host's time taken with it: the anchor `host_time` needs."""
        mark = self.mark()
        return mark, mark if not self.cuda else time.perf_counter()

    def seconds(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0  # milliseconds

    def host_time(self, mark: float | torch.cuda.Event, origin: float | torch.cuda.Event, origin_host: float) -> float:
        """`mark` on the host's clock (time.perf_counter: one clock across a machine's processes, so
        their marks compare), given `origin`, a mark taken at host time `origin_host`."""
        return mark if not self.cuda else origin_host + self.seconds(origin, mark)
