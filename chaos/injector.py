"""Rank-side fault injection at named fault points.

Protocol: the rank actor builds one `FaultInjector` per generation from the faults the
controller still has armed, and passes `injector.hook` to the engine as its fault hook.
The engine calls `hook(point, step)` at each named point. With no fault armed for the
rank, `hook_for` returns None and the engine skips the call entirely, so an unarmed run
pays nothing; even a hook with no fault of its own costs well under a microsecond per call
(tests/unit/test_chaos_nan_grad.py measures it). Before a fault fires the injector reports
it (`notify`), so the controller knows the fault's time and can measure detection latency
and disarm it (a kill_node whose parent is not the raylet raises before its notice).

`nan_grad` needs the module whose gradients it poisons: pass `target=engine.model` to
`hook_for` (or the constructor), or call `set_target(module)` before the first step. At
the armed step and point (default `after_backward`, where the engine has finished the
backward and, on DDP, the gradient all-reduce) it fills the gradient of the module's first
parameter that has one with NaN, in place; the engine's gradient clipping then spreads the
NaN to every gradient of that rank and the optimizer step writes NaN weights, as a bad
batch or a hardware fault would. The all-reduce of that step is over, so at first only the
target rank's replica holds NaN; on DDP the next step's collectives (token loss, gradient
all-reduce) carry it to every rank (tests/dist/test_chaos_nan_grad_ddp.py). A fault without
`repeat` fires once per injector.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping

from chaos.config import ArmedFault, as_armed

DEFAULT_POINT = "after_backward"
RANK_FAULTS = ("kill_rank", "kill_node", "hang_rank", "slow_rank", "raise", "nan_grad")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside a training step."""


class FaultInjector:
    def __init__(self, faults: Iterable[ArmedFault | Mapping], rank: int, notify: Callable[[dict], None],
                 target=None):
        self.rank = rank
        self.notify = notify
        armed = [as_armed(f, i) for i, f in enumerate(faults)]
        self.faults = [f for f in armed if f.rank == rank and f.kind in RANK_FAULTS]
        self.target = target  # torch.nn.Module whose gradients nan_grad poisons
        # Step timing is needed by slow_rank only; without one the hook does no clock reads.
        self._timing = any(f.kind == "slow_rank" for f in self.faults)
        self._fired: set[int] = set()  # indices of non-repeating faults that have fired
        self._step_started = time.perf_counter()
        self._last_compute = 0.0  # forward+backward seconds of the previous step
        self._slept = 0.0  # seconds slept by slow_rank in the current step

    @classmethod
    def hook_for(cls, faults: Iterable[ArmedFault | Mapping], rank: int, notify: Callable[[dict], None],
                 target=None):
        injector = cls(faults, rank, notify, target)
        return injector.hook if injector.faults else None

    def set_target(self, module) -> None:
        """The module (the engine's `model`) whose parameters' gradients nan_grad poisons."""
        self.target = module

    def hook(self, point: str, step: int) -> None:
        if self._timing:
            if point == "before_step":
                self._step_started, self._slept = time.perf_counter(), 0.0
            elif point == "after_backward":
                # The rank's own compute, without the sleep injected into it (else slowness compounds).
                self._last_compute = time.perf_counter() - self._step_started - self._slept
        for index, fault in enumerate(self.faults):
            at_step = fault.at_step
            if fault.kind == "slow_rank" and fault.delay_s is not None:
                self._delay(index, fault, point, step)
            elif fault.kind == "slow_rank":
                # A straggler stays slow from then on. It sleeps before the backward, inside the
                # compute the engine measures, as slower hardware would.
                if point == (fault.at_point or "after_forward") and (at_step is None or step >= at_step):
                    extra = (float(fault.factor) - 1.0) * self._last_compute
                    time.sleep(extra)
                    self._slept += extra
            elif (fault.at_point or DEFAULT_POINT) == point and at_step in (None, step):
                if index in self._fired:
                    continue
                if not fault.repeat:
                    self._fired.add(index)
                self._fire(fault, point, step)

    def _delay(self, index: int, fault: ArmedFault, point: str, step: int) -> None:
        """slow_rank with delay_s: step `at_step` (each generation's first when None: a warm-up such
        as compilation) sleeps `delay_s` once, inside the measured compute; every later step too
        with `repeat`. It sends no notice: a slow step is no failure for the controller to attribute."""
        if point != (fault.at_point or "after_forward") or index in self._fired:
            return
        if fault.at_step is not None and (step < fault.at_step if fault.repeat else step != fault.at_step):
            return
        if not fault.repeat:
            self._fired.add(index)
        time.sleep(float(fault.delay_s))
        self._slept += float(fault.delay_s)

    def fire_now(self, fault: ArmedFault | Mapping, step: int) -> None:
        """Fire `fault` at once, whatever its trigger (the controller's time-triggered faults)."""
        self._fire(as_armed(fault, 0), "timed", step)

    def _fire(self, fault: ArmedFault, point: str, step: int) -> None:
        kind = fault.kind
        raylet = node_raylet() if kind == "kill_node" else None  # refused before any notice: nothing fired
        # The notice is a dict of FaultFired's fields (orchestrator.wire.messages sits above this library).
        self.notify({"type": "fault", "fault_id": fault.id, "kind": kind, "rank": self.rank,
                     "step": step, "point": point, "time": time.time()})
        if kind == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "kill_node":
            crash_node(raylet)
        elif kind == "hang_rank":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "raise":
            raise InjectedFault(fault.message or f"injected exception on rank {self.rank} at step {step}")
        elif kind == "nan_grad":
            self._poison_gradient(point, step)

    def _poison_gradient(self, point: str, step: int) -> None:
        if self.target is None:
            raise RuntimeError("nan_grad needs the engine's module: FaultInjector(..., target=engine.model) "
                               "or injector.set_target(engine.model) before training")
        for param in self.target.parameters():
            if param.grad is not None:
                param.grad.fill_(float("nan"))  # in place: the optimizer and DDP's views see it
                return
        raise RuntimeError(f"nan_grad on rank {self.rank} at step {step}: no parameter has a gradient at "
                           f"{point}; use at_point: after_backward")


def node_raylet() -> int:
    """The PID of this node's raylet, this process's parent (Ray forks worker processes from it); a
    RuntimeError when the parent is something else, before a notice says a node kill fired."""
    raylet = os.getppid()
    with open(f"/proc/{raylet}/comm") as handle:
        parent = handle.read().strip()
    if not parent.startswith("raylet"):  # a wrapper in between, or the raylet already gone
        raise RuntimeError(f"kill_node: this rank's parent process {raylet} is {parent!r}, not the node's raylet; "
                           "nothing was killed")
    return raylet


def crash_node(raylet: int) -> None:
    """End every process Ray runs on this node at once (a killed container or pod, a raylet crash
    that takes its workers along): the raylet (frozen first, so that it starts nothing meanwhile),
    every process it started (rank actors, spares, Ray's agents), this one last. No rank is left to
    report the loss: the controller's probe finds the raylet's port refusing connections
    (orchestrator.cluster.node_probe), and Ray's GCS declares the node dead after its health checks."""
    os.kill(raylet, signal.SIGSTOP)
    for pid in children_of(raylet) - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.kill(raylet, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def children_of(parent: int) -> set[int]:
    """The PIDs whose parent is `parent` (Linux: read from /proc)."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    # The command name (in parentheses) may hold spaces: the fields after it are fixed.
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == parent:
                        children.add(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return children
