"""The goodput ledger: every second of a job's wall time, booked into exactly one bucket.

Buckets are `productive` (training whose effect survives in the final model) and the badput
causes of Google's ml-goodput-measurement taxonomy (docs/design.md section 4), so users can compare
numbers across tools: https://github.com/AI-Hypercomputer/ml-goodput-measurement

Protocol. The controller (single-threaded) is the only caller; the ledger takes no locks and
must not be read from other threads (metrics get a snapshot through `JobMetrics.on_goodput`).

1. `GoodputLedger(clock, carried)` opens the first interval in `startup`: the time between
   creating the ledger and the controller's first `enter` is start-up.
2. `enter(bucket)` on every state change closes the open interval into the current bucket and
   opens a new one, so time is booked as it passes and no second is booked twice.
3. `move(seconds, src, dst)` re-attributes time already booked when its cause is learned after
   the fact: a checkpoint's blocking time (productive -> checkpoint_save) once the shard
   receipts arrive, the ranks' wait for a generation's last save once they return, and the
   steps rolled back by a recovery (productive -> lost_work).
4. `to_dict()` is saved with each checkpoint, and every few seconds beside them
   (orchestrator.controller.ledger_snapshot); `GoodputLedger(carried=...)` or `carry(totals)` resumes the
   totals after a controller restart, with the predecessor's steps past the restored commit moved to
   lost_work and the time no controller ran booked to `other`.
5. `stop()` closes the last interval when the job ends, so a report built later sees the
   same totals.

Invariant (tested with a fake clock): `sum(totals().values()) == wall()` after any sequence of
`enter` and `move`.

Lost work, precisely. A recovery (or a grow) that resumes from committed step R throws away
every step >= R that finished in the generation that stopped. For each such step, rank 0's
wall time of that execution (its `step_s`: from the step's start to its end, the collectives
included, less its data wait) is lost, and so is the step the fault interrupted, from the end
of the last finished step to the fault, less what after that step was booked already (a
validation, a save's blocking). That remainder is counted only when the fault's time is known:
an injected fault, or a hang no fault explains (from the last progress and what was booked
after it, plus a median step: when the step was due); otherwise it stays where it was booked.
The controller computes it at recovery time (`JobRecord.rolled_back_seconds`) and moves it
productive -> lost_work. For an injected fault the same quantity can be recomputed after the
run from the report alone: the executions that a later execution of the same step replaced
(`RunReport.rolled_back`) plus, per failure, its fault time minus the end of the last of them
(an upper bound: the report does not list what was booked after it). The ledger test
(tests/ray/test_monitoring.py) checks the two agree. A second execution of the same steps
(`RunReport.redone_s`) measures what redoing cost, not what was lost: it runs at another time
under another machine load and after a fresh process group, so it matches lost work only as
far as step times repeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

PRODUCTIVE = "productive"
BADPUT_CAUSES = (
    "startup",
    "checkpoint_save",
    "checkpoint_restore",
    "detection",
    "reformation",
    "lost_work",
    "waiting_for_resources",
    "data",
    "other",
)
BUCKETS = (PRODUCTIVE, *BADPUT_CAUSES)


def _check_bucket(bucket: str) -> None:
    if bucket not in BUCKETS:
        raise ValueError(f"unknown goodput bucket {bucket!r}; expected one of {', '.join(BUCKETS)}")


def _validated_carry(carried: Mapping[str, float] | None) -> dict[str, float]:
    booked = dict.fromkeys(BUCKETS, 0.0)
    for bucket, seconds in (carried or {}).items():
        _check_bucket(bucket)
        if not seconds >= 0.0:  # also rejects NaN, which would poison every later total
            raise ValueError(f"carried goodput bucket {bucket!r} has {seconds!r} seconds; need >= 0")
        booked[bucket] = float(seconds)
    return booked


class GoodputLedger:
    """Splits a job's wall time into `productive` and the `BADPUT_CAUSES` (see module doc)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        carried: Mapping[str, float] | None = None,
    ) -> None:
        self._clock = clock
        self._booked = _validated_carry(carried)
        self.carried = dict(self._booked)  # what predecessors booked (their totals), not this process
        # Wall time is kept apart from the buckets (carried wall + clock elapsed) so the
        # sum-equals-wall invariant is a real check of the booking, not a tautology.
        self._carried_wall = sum(self._booked.values())
        self._started_at = clock()
        self._current: str | None = "startup"
        self._opened_at = self._started_at
        self._stopped_at: float | None = None

    @property
    def current(self) -> str | None:
        """The bucket the open interval is being booked to; None once stopped."""
        return self._current

    def enter(self, bucket: str) -> None:
        """Close the open interval into the current bucket and start booking to `bucket`."""
        _check_bucket(bucket)
        if self._current is None:
            raise RuntimeError("goodput ledger is stopped; a finished job books no more time")
        self._close_open_interval()
        self._current = bucket

    def move(self, seconds: float, src: str, dst: str) -> float:
        """Re-attribute up to `seconds` from `src` to `dst`; returns the seconds moved.

        Clamped to what `src` holds (open interval included), because a late-learned cost can
        exceed what was booked (e.g. a blocking save that overlapped a state change) and no
        bucket may go negative.
        """
        _check_bucket(src)
        _check_bucket(dst)
        if not seconds >= 0.0:
            raise ValueError(f"cannot move {seconds!r} seconds; need >= 0")
        if self._current is not None:
            self._close_open_interval()
        amount = min(float(seconds), self._booked[src])
        self._booked[src] -= amount
        self._booked[dst] += amount
        return amount

    def carry(self, carried: Mapping[str, float]) -> None:
        """Add a predecessor's totals (a resumed job's, from its checkpoint) to this ledger's.

        The carried seconds join their buckets and the wall time alike, so the buckets still sum
        to the wall; the open interval keeps running in its bucket."""
        extra = _validated_carry(carried)
        if self._current is not None:
            self._close_open_interval()
        for bucket, seconds in extra.items():
            self._booked[bucket] += seconds
            self.carried[bucket] = self.carried.get(bucket, 0.0) + seconds
        self._carried_wall += sum(extra.values())

    def stop(self) -> None:
        """Close the last interval and freeze wall time (the controller calls it at job end)."""
        if self._current is None:
            return
        self._close_open_interval()
        self._stopped_at = self._opened_at
        self._current = None

    def totals(self) -> dict[str, float]:
        """Seconds per bucket, carried seconds and the open interval included."""
        totals = dict(self._booked)
        if self._current is not None:
            totals[self._current] += self._clock() - self._opened_at
        return totals

    def badput(self) -> dict[str, float]:
        """Seconds per badput cause (every bucket but `productive`)."""
        totals = self.totals()
        return {cause: totals[cause] for cause in BADPUT_CAUSES}

    def wall(self) -> float:
        """Job wall seconds: carried wall plus time since this ledger was created."""
        end = self._stopped_at if self._stopped_at is not None else self._clock()
        return self._carried_wall + (end - self._started_at)

    def goodput(self) -> float:
        """productive / wall, or 0.0 before any time has passed."""
        wall = self.wall()
        return self.totals()[PRODUCTIVE] / wall if wall > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        """The totals as `{bucket: seconds}`, JSON-ready; pass back as `carried=` to resume."""
        return self.totals()

    def _close_open_interval(self) -> None:
        now = self._clock()
        self._booked[self._current] += now - self._opened_at
        self._opened_at = now
