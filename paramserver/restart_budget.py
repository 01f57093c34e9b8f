"""How many repairs a parameter-server job may make before it fails: the elastic section's budget.

A collective job's controller restarts after a failure until `elastic.max_restarts` are spent
within `elastic.restart_window_s`, and fails a crash loop at once (the same failure
`elastic.crash_loop_limit` times in a row: orchestrator.controller.policies.FailurePolicy). The PS
supervisor repairs differently (a worker replaced alone, or every server rolled back to the last
commit) but a job that keeps failing must still end, with the budget named: here a repair is one
replacement or one rollback, and a crash loop is `crash_loop_limit` rollbacks in a row at the
same step for the same reason, its numbers aside (its reruns fail the same way: a worker that
cannot start, a store that refuses). As in a collective job, injected faults are never a crash loop:
a chaos run's kills spend `max_restarts`.

Protocol (paramserver.supervisor, one thread): `repair(now, what)` before each repair, which raises
RestartsSpent when the window holds `max_restarts` already; `rolled_back(step, failure)` after each
rollback of the segment from `step` (`failure`: the rollback's, paramserver.recovery), which raises
RestartsSpent on the crash loop; `segment_done()` once a segment finished. The driver seeds a
rerun's budget with the repairs its earlier runs made (`carry(times)`, from the goodput snapshot
the last driver wrote as it ended, which records `repair_times()`): a rerun does not renew it.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from paramserver.recovery import Failure

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


class RestartsSpent(RuntimeError):
    """The job failed: its repairs are spent, or it is in a crash loop; the message names the field."""


@dataclass
class RestartBudget:
    max_restarts: int = 10  # elastic.max_restarts
    window_s: float | None = 86400.0  # elastic.restart_window_s; None: every repair (earlier runs' carried)
    crash_loop_limit: int = 3  # elastic.crash_loop_limit
    _repairs: deque[float] = field(default_factory=deque, init=False, repr=False)
    _in_a_row: int = field(default=0, init=False, repr=False)
    _last: tuple | None = field(default=None, init=False, repr=False)  # the last rollback's (step, reason shape)
    _carried: int = field(default=0, init=False, repr=False)  # of `_repairs`, the earlier runs' (the oldest)

    def carry(self, times: list[float]) -> None:
        """Earlier runs' repairs (wall times), before this run's first: at most a budget's worth; those
        out of the window leave it as this run's own do, at the next `repair`."""
        carried = sorted(times)[-self.max_restarts:] if self.max_restarts else []
        self._repairs.extend(carried)
        self._carried = len(carried)

    def repair_times(self) -> list[float]:
        return list(self._repairs)

    def repair(self, now: float, what: str) -> None:
        while self.window_s is not None and self._repairs and self._repairs[0] <= now - self.window_s:
            self._repairs.popleft()
            self._carried = max(0, self._carried - 1)
        if len(self._repairs) >= self.max_restarts:
            within = ("" if self.window_s is None else f" in the last {self.window_s:g} s") + (
                f" ({self._carried} by earlier runs of this job)" if self._carried else "")
            window = "" if self.window_s is None else f" per elastic.restart_window_s={self.window_s:g}"
            raise RestartsSpent(f"{len(self._repairs)} repairs used{within} (elastic.max_restarts="
                                f"{self.max_restarts}{window}); not repaired: {what}")
        self._repairs.append(now)

    def rolled_back(self, step: int, failure: Failure) -> None:
        if failure.injected_at is not None:
            return
        # Where it failed (the rollback's step and the steps it threw away) and why, numbers aside: a
        # hang's "for 10.3 s" differs at every repeat.
        key = (step + failure.steps_redone, _NUMBER.sub("#", failure.reason))
        self._in_a_row, self._last = (self._in_a_row + 1 if key == self._last else 1), key
        if self._in_a_row >= self.crash_loop_limit:
            raise RestartsSpent(f"crash loop: the segment from step {step} was rolled back {self._in_a_row} times "
                                f"in a row for the same reason (elastic.crash_loop_limit={self.crash_loop_limit}); "
                                f"last: {failure.line()}")

    def segment_done(self) -> None:
        self._in_a_row, self._last = 0, None
