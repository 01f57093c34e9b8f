"""Prometheus series of a parameter-server job: the staleness of every applied update, the
servers' byte counters and versions, and the workers' pull waits.

Protocol. The ps job's driver (orchestrator/cli/ps_run.py) makes the job's `JobMetrics`
(monitor.metrics) and serves it on `monitor.host` / `monitor.port` as a collective job does, and
makes one `PSMetrics` on the same registry. Whenever it has fetched the servers' stats
(`paramserver.actors.ServerStats`: while the workers run, before each save, and once at the
end) it calls `on_server_stats` with them; with worker step logs (`paramserver.actors.StepLog`)
it has not passed before, `on_steps`. Both from the driver's one thread; scrapes read the
prometheus-client objects, which are thread-safe.

Each stats answer carries the update records new since the previous one of its server
(paramserver.update_history), each passed once: every record is observed, and the histogram's
count is the number of updates applied. A rollback to the last commit undoes the updates after
it; their redone ones come as new records, so the undone ones stay counted (they were applied).
Byte counters are cumulative per server actor: counters smaller than before belong to a new
actor (a replaced shard), all of whose bytes are new.

This module reads the stats by attribute (`server`, `version`, `bytes_in`, `bytes_out`,
`records` with `staleness`; `pull_wait_s`), so monitor does not import paramserver (one layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from monitor.metrics import STEP_BUCKETS

# Upper bounds in server versions. bsp is all 0; ssp's staleness is about (workers - 1) x
# (bound + 1) per server, asp's grows with a straggler's lag.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class _Record(Protocol):
    staleness: int
    step: int


class _Stats(Protocol):
    server: int
    version: int
    bytes_in: int
    bytes_out: int
    records: list[_Record]


class _StepLog(Protocol):
    pull_wait_s: float


@dataclass
class _Seen:
    bytes_in: int = 0
    bytes_out: int = 0


class PSMetrics:
    """The parameter-server series of one job, on `registry` (see the module doc)."""

    def __init__(self, job: str, consistency: str, servers: int, registry: CollectorRegistry) -> None:
        self.job, self.consistency = job, consistency
        self._seen: dict[int, _Seen] = {}
        labels = ["undying_job", "consistency", "server"]
        self.staleness = Histogram(
            "undying_ps_update_staleness", "Staleness of each update a parameter server applied: its version "
            "when applying minus the version the gradient was computed on.", labels, buckets=STALENESS_BUCKETS,
            registry=registry)
        self.pushed = Counter(
            "undying_ps_pushed_bytes", "Gradient payload bytes pushed to each server (rows and values; Ray's "
            "framing not counted).", labels, registry=registry)
        self.pulled = Counter(
            "undying_ps_pulled_bytes", "Parameter payload bytes pulled from each server.", labels, registry=registry)
        self.version = Gauge("undying_ps_server_version", "Updates each server has applied.", labels,
                             registry=registry)
        self.pull_wait = Histogram(
            "undying_ps_pull_wait_seconds", "Seconds a worker's step waited for its pulls (the consistency "
            "bound's wait included).", ["undying_job", "consistency"], buckets=STEP_BUCKETS, registry=registry)
        # Every series from the first scrape: rate() needs a zero to start from.
        for server in range(servers):
            for metric in (self.staleness, self.pushed, self.pulled, self.version):
                metric.labels(*self._labels(server))
        self.pull_wait.labels(job, consistency)

    def _labels(self, server: int) -> tuple[str, str, str]:
        return self.job, self.consistency, str(server)

    def on_server_stats(self, stats: Iterable[_Stats]) -> int:
        """Observe each server's new update records and its counters' growth; returns the updates observed."""
        observed = 0
        for snapshot in stats:
            seen = self._seen.setdefault(snapshot.server, _Seen())
            if snapshot.bytes_in < seen.bytes_in or snapshot.bytes_out < seen.bytes_out:
                seen.bytes_in = seen.bytes_out = 0  # a new actor's counters
            labels = self._labels(snapshot.server)
            histogram = self.staleness.labels(*labels)
            for record in snapshot.records:
                histogram.observe(record.staleness)
            observed += len(snapshot.records)
            self.pushed.labels(*labels).inc(snapshot.bytes_in - seen.bytes_in)
            self.pulled.labels(*labels).inc(snapshot.bytes_out - seen.bytes_out)
            self.version.labels(*labels).set(snapshot.version)
            seen.bytes_in, seen.bytes_out = snapshot.bytes_in, snapshot.bytes_out
        return observed

    def on_steps(self, logs: Iterable[_StepLog]) -> None:
        """Worker steps not passed before (each step log once)."""
        histogram = self.pull_wait.labels(self.job, self.consistency)
        for log in logs:
            histogram.observe(log.pull_wait_s)


class StepRate:
    """Steps per second of a parameter-server job, from the servers' stats: the newest applied
    update's step at each `on_stats` (the driver's poll), against the first one seen. Its
    wall time includes the checkpoint saves, so `every_steps / rate` is the time between commits
    (the no-commit alert's interval, as a collective job exports it). A rollback (the step goes
    back from the last one seen) starts the count again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.origin: tuple[float, int] | None = None  # (time, step) the rate is counted from
        self.last = -1  # the step seen at the previous call
        self.rate: float | None = None

    def on_stats(self, stats: Iterable[_Stats]) -> float | None:
        steps = [snapshot.records[-1].step for snapshot in stats if snapshot.records]
        if not steps:
            return self.rate
        now, step = self.clock(), max(steps)
        rolled_back, self.last = step < self.last, step
        if self.origin is None or rolled_back:
            self.origin = (now, step)
        elif step > self.origin[1] and now > self.origin[0]:
            self.rate = (step - self.origin[1]) / (now - self.origin[0])
        return self.rate
