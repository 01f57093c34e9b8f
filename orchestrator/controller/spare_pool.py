"""The warm spare pool: refilled in the background when a spare takes over, watched until warm.

A spare is a rank actor that has imported torch and built a first engine (RankActor.warm_up)
and waits in its own seat of the placement group; taking over a lost rank then costs a process
group join instead of a process start (docs/design.md, "Spares"). The pool is every seat that
holds no rank: `elastic.spares` seats beyond the ranks at placement, plus the seats ranks left
(a promoted spare's rank keeps the spare's seat, so the dead rank's seat is free for a new one).

Protocol (controller thread only; nothing here waits on an actor):
  * `refill(why)`: start a spare in every free seat not on a draining node (RayWorkerGroup.start_spares: the actor is
    created and warms up on its own) and say so in one sentence. Called at placement and at every
    checkpoint commit (`Recovery.grow_to`: a seat that was on a lost node comes back once Ray
    re-places its bundle on a live node, and gets its spare then).
  * `refill_later(why)`: after a membership change (`Recovery.replace`: a spare promoted, a cold
    replacement, a shrink). The refill waits for the recovery's first step: a new actor imports
    torch (seconds of a core) and would otherwise compete with the restore it was started beside
    (0.49 s against 0.63 s kill-to-first-step on the 4-rank CPU demo, docs/benchmarks.md).
  * `wait_for_warming_s(limit_s)`: at a recovery that found no warm spare, how long to wait for
    one still warming (Recovery.replace): it started earlier than any new actor could, and a new
    actor beside it would halve the CPU each gets on a busy host.
  * `watch(settled)`: once per training poll (`settled`: no recovery still awaits its first
    step), and before spares are promoted. Makes a deferred refill once settled; notes each spare
    a refill started that has finished warming (one sentence with its warm-up time) or died
    meanwhile, and exports the pool (`undying_spares_ready`, `undying_spares_warming`); a poll
    with nothing to do asks Ray nothing.
`target` is `elastic.spares` as the CLI resolved it against the cluster
(orchestrator.cluster.capacity.resolve_spares); a controller handed an unresolved `auto` keeps none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class SparePool:
    def __init__(self, spec, workers, metrics, log: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 draining: Callable[[], Iterable[str]] = tuple):
        spares = spec.elastic.spares
        self.target = 0 if spares == "auto" else spares
        self.workers, self.metrics, self.log, self.clock = workers, metrics, log, clock
        self.draining = draining  # the nodes Ray drains now: no spare starts in their seats
        self.warming: dict[int, float] = {}  # seat -> clock() when a refill started its spare
        self.longest_warm_s = 0.0  # the longest warm-up seen so far (bounds a recovery's wait for one)
        self.deferred: list[str] = []  # why refills wait for the recovery's first step

    def refill(self, why: str) -> list[int]:
        """Start a spare in every free seat (no waiting); returns the seats started. A deferred
        refill is served by this one (a commit means training runs again), and named."""
        if self.deferred:
            why = ", ".join(self.deferred) + ", training again"
            self.deferred.clear()
        seats = sorted(self.workers.start_spares(set(self.draining())))
        if not seats:
            return []
        now = self.clock()
        self.warming.update(dict.fromkeys(seats, now))
        self.metrics.on_spares_started(len(seats))
        ready = self._export()
        self.log(f"spare pool: {why}; {len(seats)} new spare(s) warming up in the background in seat(s) "
                 f"{seats} ({ready} of {len(self.workers.spare_seats())} warm now)")
        return seats

    def refill_later(self, why: str) -> None:
        """Refill once the recovery under way has trained its first step (`watch(settled=True)`)."""
        self.deferred.append(why)

    def watch(self, settled: bool) -> None:
        """Make a deferred refill once `settled`; note the spares that finished warming (or died)
        since the last call; export the pool."""
        if settled and self.deferred:
            self.refill("deferred")
        if not self.warming:
            return
        ready = set(self.workers.ready_spares())
        held = set(self.workers.spare_seats())
        now = self.clock()
        for seat in sorted(self.warming):
            if seat in ready:
                took = now - self.warming.pop(seat)
                self.longest_warm_s = max(self.longest_warm_s, took)
                self.log(f"spare pool: the new spare in seat {seat} is warm, {took:.1f} s "
                         f"after it was started ({len(ready)} of {len(held)} spare(s) warm)")
            elif seat not in held:  # died while warming, dropped with a lost node, or promoted as it finished
                del self.warming[seat]
                self.log(f"spare pool: the new spare in seat {seat} left the pool before it was seen warm")
        self.metrics.on_spares(len(ready), len(held) - len(ready))

    def wait_for_warming_s(self, limit_s: float) -> float:
        """How long a recovery that found no warm spare may wait for one still warming up (0: none is):
        until twice the longest warm-up seen so far has passed since the oldest was started, at most
        `limit_s` (also the bound before any warm-up was seen). Recovery.replace passes half of
        elastic.replace_timeout_s, and new actors get the rest of that timeout. The bound
        keeps a spare that cannot start (its seat's resources gone) from delaying the cold path long."""
        if not self.warming:
            return 0.0
        if not self.longest_warm_s:
            return limit_s
        elapsed = self.clock() - min(self.warming.values())
        return max(0.0, min(limit_s, 2 * self.longest_warm_s - elapsed))

    def _export(self) -> int:
        ready = len(self.workers.ready_spares())
        self.metrics.on_spares(ready, len(self.workers.spare_seats()) - ready)
        return ready
