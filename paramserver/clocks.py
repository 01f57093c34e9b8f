"""Worker clocks, the consistency bound, and the record of every update's staleness. Pure.

A worker's clock is the number of steps it has pushed to a server (its next step). Every
worker pushes to every server once per step (an empty push where it touched nothing the
server owns), so each server keeps the clocks itself and no coordinator exists.

The bound (`ahead_limit`): a worker about to compute step c may read a server's parameters
once the slowest worker's clock there is >= c - limit:
    bsp  limit 0     every gradient of steps < c is in (the one aggregated update applied)
    ssp  limit s     at most s steps ahead of the slowest (Ho et al., NIPS'13, "More effective
                     distributed ML via a stale synchronous parallel parameter server")
    asp  no limit    read whatever is there
A server's version counts the updates it applied (bsp: one per step; ssp and asp: one per
push). Staleness of an update = the server's version when it is applied minus the version
the gradient was computed on (the one the worker pulled).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def ahead_limit(consistency: str, staleness: int | None) -> int | None:
    """Steps a worker may run ahead of the slowest; None: unbounded (asp)."""
    if consistency == "bsp":
        return 0
    if consistency == "ssp":
        assert staleness is not None, "the spec check requires parallel.staleness with ssp"
        return staleness
    return None


@dataclass(frozen=True)
class UpdateRecord:
    """One worker's push as a server applied it (bsp: with the other workers' of its step)."""

    server: int
    worker: int
    step: int  # the worker's step the gradient belongs to
    pulled_version: int  # the server version the gradient was computed on
    applied_version: int  # the server version it was applied to (before the update counted)
    slowest_at_pull: int  # the slowest worker's clock when the pull was granted

    @property
    def staleness(self) -> int:
        return self.applied_version - self.pulled_version

    @property
    def ahead(self) -> int:
        """How many steps ahead of the slowest worker this gradient's read was."""
        return self.step - self.slowest_at_pull


class Clocks:
    """One server's view of every worker's clock. Not thread-safe: one event loop drives it."""

    def __init__(self, workers: int):
        self.pushed = [0] * workers

    @property
    def slowest(self) -> int:
        return min(self.pushed)

    def may_read(self, step: int, limit: int | None) -> bool:
        """Whether a worker about to compute `step` may pull now."""
        return limit is None or self.slowest >= step - limit

    def tick(self, worker: int, step: int) -> None:
        """`worker` pushed `step`; pushes of one worker arrive in step order."""
        if step != self.pushed[worker]:
            raise ValueError(f"worker {worker} pushed step {step}, expected step {self.pushed[worker]}")
        self.pushed[worker] = step + 1


def staleness_histogram(records: list[UpdateRecord]) -> dict[int, int]:
    """{staleness: updates}, in increasing staleness."""
    return dict(sorted(Counter(r.staleness for r in records).items()))


def format_histogram(histogram: dict[int, int], width: int = 40) -> str:
    """Lines of 'staleness  count  bar' for the report."""
    if not histogram:
        return "  (no updates)"
    top = max(histogram.values())
    return "\n".join(f"  {s:>4}  {n:>7}  {'#' * max(1, round(width * n / top))}" for s, n in histogram.items())
