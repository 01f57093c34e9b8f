"""Rank-side fault injection at named fault points.

Protocol: the rank actor builds one `FaultInjector` per generation from the faults the
controller still has armed, and passes `injector.hook` to the engine as its fault hook.
The engine calls `hook(point, step)` at each named point. With no fault armed for the
rank, `hook` is None and the engine skips the call entirely, so an unarmed run pays
nothing. Before a fault fires the injector reports it (`notify`), so the controller knows
the fault's time and can measure detection latency and disarm it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

DEFAULT_POINT = "after_backward"
RANK_FAULTS = ("kill_rank", "hang_rank", "slow_rank", "raise")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside a training step."""


class FaultInjector:
    def __init__(self, faults: list[dict], rank: int, notify: Callable[[dict], None]):
        self.rank = rank
        self.notify = notify
        self.faults = [f for f in faults if f.get("rank") == rank and f["kind"] in RANK_FAULTS]
        self._step_started = time.perf_counter()
        self._last_compute = 0.0  # forward+backward seconds of the previous step
        self._slept = 0.0  # seconds slept by slow_rank in the current step

    @classmethod
    def hook_for(cls, faults: list[dict], rank: int, notify: Callable[[dict], None]):
        injector = cls(faults, rank, notify)
        return injector.hook if injector.faults else None

    def hook(self, point: str, step: int) -> None:
        if point == "before_step":
            self._step_started, self._slept = time.perf_counter(), 0.0
        elif point == "after_backward":
            # The rank's own compute, without the sleep injected into it (else slowness compounds).
            self._last_compute = time.perf_counter() - self._step_started - self._slept
        for fault in self.faults:
            at_step = fault.get("at_step")
            if fault["kind"] == "slow_rank":
                # A straggler stays slow from then on. It sleeps before the backward, inside the
                # compute the engine measures, as slower hardware would.
                if point == (fault.get("at_point") or "after_forward") and (at_step is None or step >= at_step):
                    extra = (float(fault["factor"]) - 1.0) * self._last_compute
                    time.sleep(extra)
                    self._slept += extra
            elif (fault.get("at_point") or DEFAULT_POINT) == point and at_step in (None, step):
                self._fire(fault, point, step)

    def _fire(self, fault: dict, point: str, step: int) -> None:
        kind = fault["kind"]
        self.notify({"type": "fault", "fault_id": fault["id"], "kind": kind, "rank": self.rank,
                     "step": step, "point": point, "time": time.time()})
        if kind == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang_rank":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            raise InjectedFault(fault.get("message") or f"injected exception on rank {self.rank} at step {step}")
