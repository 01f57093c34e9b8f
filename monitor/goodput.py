"""The goodput ledger: every second of a job's wall time, booked into exactly one bucket.

Buckets are `productive` (training whose effect survives in the final model) and the badput
causes of Google's ml-goodput-measurement taxonomy (docs/design.md section 4), so users can compare
numbers across tools: https://github.com/AI-Hypercomputer/ml-goodput-measurement

Protocol. The controller (single-threaded) is the only caller; the ledger takes no locks and
must not be read from other threads: metrics get a `LedgerReading` through `JobMetrics.on_goodput`,
which keeps counting the open interval, so a scrape during an outage sees it grow.

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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LedgerReading:
    """The ledger as another thread may read it (a Prometheus scrape): the seconds booked, and the
    interval still open, which `totals` extends to the moment it is asked. Between two of the
    controller's readings (a step's record, a state change) the open bucket keeps growing, so a
    restore that keeps failing, a long wait for capacity or a hang shows as it passes, not only once
    training resumes. `prior`: the part of the totals the job's earlier drivers booked themselves."""
    booked: Mapping[str, float]
    open_bucket: str | None
    opened_at: float
    clock: Callable[[], float]
    prior: Mapping[str, float]

    def totals(self) -> dict[str, float]:
        totals = dict(self.booked)
        if self.open_bucket is not None:
            totals[self.open_bucket] += max(0.0, self.clock() - self.opened_at)
        return totals


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
        # What earlier drivers booked themselves, as they booked it (before a resume's reckoning
        # moved their steps past the restored commit to lost_work and booked the time no driver
        # ran): the base this driver's badput counters count from (monitor.goodput_collector).
        self.prior = dict(self._booked)
        self._started_at = clock()
        self._current: str | None = "startup"
        self._opened_at = self._started_at
        self._stopped_at: float | None = None
        self._watchers: list[Callable[[LedgerReading], None]] = []

    @property
    def current(self) -> str | None:
        """The bucket the open interval is being booked to; None once stopped."""
        return self._current

    def watch(self, watcher: Callable[[LedgerReading], None]) -> None:
        """Hand `watcher` the reading now and after every change (`enter`, `move`, `carry`, `stop`), on
        the caller's thread: a scrape then extends the bucket the job is in, whoever entered it."""
        if watcher not in self._watchers:
            self._watchers.append(watcher)
        watcher(self.reading())

    def _changed(self) -> None:
        for watcher in self._watchers:
            watcher(self.reading())

    def enter(self, bucket: str) -> None:
        """Close the open interval into the current bucket and start booking to `bucket`."""
        _check_bucket(bucket)
        if self._current is None:
            raise RuntimeError("goodput ledger is stopped; a finished job books no more time")
        self._close_open_interval()
        self._current = bucket
        self._changed()

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
        self._changed()
        return amount

    def carry(self, carried: Mapping[str, float], prior: Mapping[str, float] | None = None) -> None:
        """Add a predecessor's totals (a resumed job's, from its checkpoint) to this ledger's.

        The carried seconds join their buckets and the wall time alike, so the buckets still sum
        to the wall; the open interval keeps running in its bucket. `prior`: the totals as the
        predecessors booked them, before the resume's reckoning (default: `carried`)."""
        extra = _validated_carry(carried)
        if self._current is not None:
            self._close_open_interval()
        for bucket, seconds in extra.items():
            self._booked[bucket] += seconds
            self.carried[bucket] = self.carried.get(bucket, 0.0) + seconds
        for bucket, seconds in _validated_carry(carried if prior is None else prior).items():
            self.prior[bucket] = self.prior.get(bucket, 0.0) + seconds
        self._carried_wall += sum(extra.values())
        self._changed()

    def stop(self) -> None:
        """Close the last interval and freeze wall time (the controller calls it at job end)."""
        if self._current is None:
            return
        self._close_open_interval()
        self._stopped_at = self._opened_at
        self._current = None
        self._changed()

    def totals(self) -> dict[str, float]:
        """Seconds per bucket, carried seconds and the open interval included."""
        return self.reading().totals()

    def reading(self) -> LedgerReading:
        """A copy another thread may read: its `totals()` go on counting the open interval."""
        return LedgerReading(dict(self._booked), self._current, self._opened_at, self._clock, dict(self.prior))

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
