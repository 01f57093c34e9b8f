"""SIGTERM and SIGINT for a parameter-server job (`undying run` with `parallel.mode: ps`).

A PS job saves at a cut: every server at the same step. A signal cuts the segment under way at
the earliest step every worker can stop at (paramserver.moves.cut_segment: a step or so away),
the cut is saved and the job stops there with nothing lost; the job's last segment instead runs on
to the job's end. Either waits only while the stop can still be saved within
`elastic.preemption_grace_s`: until the grace has left half of itself, or twice the last save's
time if that is more (`cut_now`); past that the segment is stopped where it is: the last commit
stays intact and the steps since it are redone by the rerun. Either way the job ends PREEMPTED
(exit 75), its actors killed and its owner lease released by the caller. A SIGINT after the first
signal (Ctrl-C again) stops it at once, wherever the driver is (the handler raises): the way out of
a driver stuck in a save or a restore. A repeated SIGTERM is the same request (a pod's stoppers
each send one), still within the first one's grace.

Protocol: `undying run` routes the signals to `on_signal` and each commit to `on_commit`; the
supervisor (paramserver.supervisor) asks `cut_now()` at each poll of a segment after a signal, and
when it says yes stops the segment (within `left_s()`) and raises `preempted(last commit)`, else
cuts the segment once (not the job's last); after a segment that is not the job's last it raises
`preempted(...)` if a signal came.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable


class Preempted(BaseException):
    """The job stopped for a signal; the message says at which commit. A BaseException, as
    KeyboardInterrupt is: a SIGINT after the first signal raises it from the handler wherever the driver is, and
    the handlers that turn any failure of a call into a fallback (a server move that did not
    restore, a worker's stream that ended with an error) must not take it for one."""


class Preemption:
    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic):
        self.grace_s, self.clock = grace_s, clock
        self.signals: list[str] = []
        self.signalled_at: float | None = None
        self.save_s = 0.0  # the last commit's time, first staging to manifest
        self.ending = False  # the driver's report and teardown: a signal is recorded, never raised

    def on_signal(self, signum: int, _frame=None) -> None:
        self.signalled_at = self.signalled_at or self.clock()
        self.signals.append(signal.Signals(signum).name)
        if len(self.signals) > 1 and self.signals[-1] == "SIGINT" and not self.ending:
            raise Preempted("SIGINT during the grace: stopped at once; the last commit is intact, "
                            "rerun the job to resume")

    def on_commit(self, commit) -> None:
        self.save_s = commit.total_s

    def left_s(self) -> float:
        """The grace left (all of it before a signal)."""
        return self.grace_s if self.signalled_at is None else self.signalled_at + self.grace_s - self.clock()

    def slack_s(self) -> float:
        """How long until `cut_now` says yes (the stop must begin)."""
        return self.left_s() - max(self.grace_s / 2, 2 * self.save_s)

    def cut_now(self) -> bool:
        """Whether the segment under way must stop where it is (its cut or end could not be saved in time)."""
        return bool(self.signals) and self.slack_s() <= 0

    def preempted(self, committed: int | None, saved_now: bool) -> Preempted:
        if saved_now:
            how = f"stopped at checkpoint step {committed}, just committed"
        elif committed is not None:
            how = (f"the segment under way stopped; checkpoint step {committed} intact, the steps since "
                   "redone by the rerun")
        else:
            how = "the segment under way stopped before any checkpoint; the rerun starts from step 0"
        return Preempted(f"{self.signals[0]}: {how}; rerun the job to resume")
