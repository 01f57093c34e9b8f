"""The parameter-server supervisor's hang watchdog, without Ray: which worker or server stopped moving.

A worker whose actor dies ends its stream and a server that dies fails its progress call, and
the supervisor repairs both; one that hangs (SIGSTOP, a deadlock, a stuck device or file system)
does neither, and a bsp job would wait for it forever. The watchdog's rules:

  * a worker is suspect once it has landed no step for its limit while no unfinished worker is
    behind it (its next step is the lowest): under bsp and ssp the workers ahead of it wait for
    it in their pulls, silent too, and are not to blame. Its limit is the first-step limit while
    its actor has landed no step (building the model, a cold start: `elastic.first_step_timeout_s`),
    else max(floor, factor x the median step) (`elastic.hang_timeout_s`), the median the job's or,
    when longer, the worker's own (a steady straggler under ssp or asp is slow, not hung). Silence
    is measured on the driver's clock (a step counts from when the driver took its log), step
    times on the worker's;
  * a suspect is hung once it stays silent `outage_s` longer (a live worker may be waiting out its
    data store's outage, `data.read_retry_s`, which ends in an error of its own), or at once when a
    liveness probe sent when it became suspect has not answered in PROBE_S (a stopped process);
  * a server is hung when a progress call (answered in milliseconds by its event loop) has been
    outstanding for the steady limit, or for the first-step limit while the server has answered
    none since it started (its actor builds its shard).

Protocol (paramserver.supervisor's loop, one thread; unit tests with a fake clock):
`started(w)` when a worker actor is created, `launched(w, step)` when its run of a segment starts,
`landed(w, step, at)` for each step log, `ended(w)` when its stream ends; each poll, `to_probe()`
(the suspects to probe, which the caller does) and `probe_answered(w)` when a probe answers, then
`hung_workers()` (to kill: a hung worker's replacement is a dead worker's) and
`server_hung(asked_at)` per outstanding progress call; `silent_since(w)` dates a hang (the time to
its detection is booked as detection).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

PROBE_S = 5.0  # a live worker answers a probe (its actor's second thread) within milliseconds
MEDIAN_OF = 101  # step intervals the median is taken over: the recent ones, an odd count


@dataclass(frozen=True)
class HangLimits:
    """The limits, derived from the spec by the driver (orchestrator.controller.timeouts.derive):
    steady max(floor_s, factor x median step), factor 0 when `elastic.hang_timeout_s` is a number."""

    floor_s: float = 10.0
    factor: float = 5.0
    first_step_s: float = 120.0
    outage_s: float = 0.0  # data.read_retry_s for prepared datasets (the reads that are retried)

    def describe(self) -> str:
        steady = f"{self.floor_s:g} s" if not self.factor else f"max({self.floor_s:g} s, {self.factor:g} x median step)"
        outage = f", a live worker {self.outage_s:g} s more (data.read_retry_s)" if self.outage_s else ""
        return f"hang {steady}, first step {self.first_step_s:g} s{outage}"


@dataclass
class _Worker:
    next_step: int  # the step its run computes next
    since: float  # its last landed step, or its run's launch
    running: bool = True
    fresh: bool = True  # its actor has landed no step yet: the first-step limit
    last_landed: float | None = None  # the worker's clock at its last step's end
    probe_at: float | None = None  # an unanswered probe's sending time
    probed_at: float = -float("inf")  # the last probe's sending time
    answered_at: float = -float("inf")  # the last probe's answer


class HangWatch:
    def __init__(self, limits: HangLimits, clock: Callable[[], float] = time.time):
        self.limits, self.clock = limits, clock
        self._workers: dict[int, _Worker] = {}
        self._intervals: deque[float] = deque(maxlen=MEDIAN_OF)  # every worker's recent steps
        self._own: dict[int, deque[float]] = {}  # each worker actor's recent steps

    # ---- what the supervisor saw ----

    def started(self, w: int) -> None:
        lowest = self._lowest()
        self._workers.pop(w, None)  # a new actor: its first step builds it
        self._own.pop(w, None)
        self._caught_up(lowest)

    def launched(self, w: int, step: int) -> None:
        old = self._workers.get(w)
        self._workers[w] = _Worker(step, self.clock(), fresh=old is None or old.fresh)

    def landed(self, w: int, step: int, at: float) -> None:
        seen, lowest = self._workers.get(w), self._lowest()
        if seen is None:
            return
        if seen.last_landed is not None and at > seen.last_landed:  # both on the worker's clock
            self._intervals.append(at - seen.last_landed)
            self._own.setdefault(w, deque(maxlen=MEDIAN_OF)).append(at - seen.last_landed)
        seen.next_step, seen.since, seen.last_landed = step + 1, max(seen.since, self.clock()), at
        seen.fresh, seen.probe_at = False, None
        self._caught_up(lowest)

    def ended(self, w: int) -> None:
        lowest = self._lowest()
        if w in self._workers:
            self._workers[w].running = False
        self._caught_up(lowest)

    def _lowest(self) -> int | None:
        return min((seen.next_step for seen in self._workers.values() if seen.running), default=None)

    def _caught_up(self, before: int | None) -> None:
        """The workers that were ahead of the lowest next step `before` and are at the lowest now: they
        were waiting for the others (bsp, ssp), so their silence counts from now."""
        now = self._lowest()
        for seen in self._workers.values():
            if seen.running and seen.next_step == now and before is not None and seen.next_step > before:
                seen.since = max(seen.since, self.clock())

    # ---- limits ----

    def median_step_s(self, w: int | None = None) -> float | None:
        """The job's median step, or worker `w`'s own (its actor's) when given."""
        steps = self._intervals if w is None else self._own.get(w)
        return statistics.median(steps) if steps else None

    def steady_s(self, w: int | None = None) -> float:
        median = max(self.median_step_s() or 0.0, (self.median_step_s(w) or 0.0) if w is not None else 0.0)
        return max(self.limits.floor_s, self.limits.factor * median)

    def limit(self, w: int) -> tuple[float, str]:
        """Worker `w`'s limit now and the spec field that sets it (a hang's message names it)."""
        steady = self.steady_s(w)
        if self._workers[w].fresh and self.limits.first_step_s > steady:
            return self.limits.first_step_s, "elastic.first_step_timeout_s"
        return steady, "elastic.hang_timeout_s"

    def silent_since(self, w: int) -> float:
        return self._workers[w].since

    # ---- decisions ----

    def suspects(self) -> list[int]:
        """Running workers silent past their limit with no running worker behind them."""
        running = {w: seen for w, seen in self._workers.items() if seen.running}
        if not running:
            return []
        lowest, now = min(seen.next_step for seen in running.values()), self.clock()
        return [w for w, seen in sorted(running.items())
                if seen.next_step == lowest and now - seen.since >= self.limit(w)[0]]

    def to_probe(self) -> list[int]:
        """The suspects to probe now (the caller sends the probes): each without an outstanding probe,
        at most one every PROBE_S (a live worker waiting out a data outage is probed again, in case
        it stops meanwhile)."""
        now, out = self.clock(), []
        for w in self.suspects():
            seen = self._workers[w]
            if seen.probe_at is None and now - seen.probed_at >= PROBE_S:
                seen.probe_at = seen.probed_at = now
                out.append(w)
        return out

    def probe_answered(self, w: int) -> None:
        if w in self._workers:
            self._workers[w].probe_at, self._workers[w].answered_at = None, self.clock()

    def hung_workers(self) -> list[tuple[int, str]]:
        """(worker, why) for each suspect that is hung: silent past its limit and the data outage
        allowance, or its probe unanswered for PROBE_S."""
        now, out = self.clock(), []
        for w in self.suspects():
            seen, (limit, setting) = self._workers[w], self.limit(w)
            silent = now - seen.since
            unanswered = seen.probe_at is not None and now - seen.probe_at >= PROBE_S
            if silent >= limit + self.limits.outage_s or unanswered:
                answer = (f" and did not answer a probe for {PROBE_S:.0f} s" if unanswered else
                          " and answers, but made no step" if seen.answered_at >= seen.since else "")
                out.append((w, f"worker {w} made no step for {silent:.1f} s ({setting} {limit:.1f} s){answer}"))
        return out

    def server_hung(self, asked_at: float, started: bool = False) -> str | None:
        """Why a server whose progress call has been outstanding since `asked_at` is hung, or None;
        `started`: it has answered none since its actor started (the first-step limit)."""
        silent, limit, setting = self.clock() - asked_at, self.steady_s(), "elastic.hang_timeout_s"
        if started and self.limits.first_step_s > limit:
            limit, setting = self.limits.first_step_s, "elastic.first_step_timeout_s"
        if silent < limit:
            return None
        return f"did not answer a progress call for {silent:.1f} s ({setting} {limit:.1f} s)"
