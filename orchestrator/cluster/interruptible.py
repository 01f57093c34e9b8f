"""Waits on Ray that a signal can end: the controller's long waits (placement, actor start-up,
rendezvous, restore, replacements) in slices of at most `SLICE_S`.

Why: the controller acts on a signal between its state handlers (orchestrator.controller.stopping),
and a handler may wait minutes (a restore of a large checkpoint, a replacement that cannot be
placed). A preempted pod gets a grace of tens of seconds before SIGKILL: a SIGTERM that waits for
the handler ends the driver by SIGKILL, with no report and the owner lease left to expire. So
each slice asks `interrupted()` (the controller's "would the job end now?") and raises
`Interrupted` when it says yes; the controller catches it and ends the job (PREEMPTED).

`Interrupted` is a BaseException, like KeyboardInterrupt: the handlers' `except Exception`
(a failed rendezvous or restore is a rank failure to recover from) must not take it for one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError

SLICE_S = 0.5


class Interrupted(BaseException):
    """A wait given up because the job is ending (a signal, or the checkpoint root taken over)."""


def never() -> bool:
    return False


def wait(refs: list, num_returns: int, timeout_s: float, interrupted: Callable[[], bool] = never) -> tuple[list, list]:
    """`ray.wait(refs, num_returns, timeout_s)`, raising Interrupted between slices."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready, rest = ray.wait(refs, num_returns=num_returns, timeout=max(0.0, min(SLICE_S, left)))
        # By the clock, not by the slice asked for: ray.wait may come back a fraction of a ms early.
        if len(ready) >= num_returns or time.monotonic() >= deadline:
            return ready, rest
        if interrupted():
            raise Interrupted("the job is ending")


def get(refs: list, timeout_s: float, interrupted: Callable[[], bool] = never) -> list:
    """`ray.get(refs, timeout=timeout_s)`, raising Interrupted between slices; a call that failed
    raises its error within a slice of failing, as ray.get would."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(SLICE_S, left)))
        ray.get(ready)  # a failed call's error, now
        if pending and time.monotonic() >= deadline:
            raise GetTimeoutError(f"{len(pending)} of {len(refs)} call(s) not done within {timeout_s:.0f} s")
        if pending and interrupted():
            raise Interrupted("the job is ending")
    return ray.get(list(refs))
