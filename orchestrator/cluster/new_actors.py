"""New rank actors coming up: what a call on a gone one raises, and the wait for a batch of them.

Protocol: RayWorkerGroup (controller thread) creates the actors in their seats, then calls
`pings_within` once for the batch; it re-creates an actor through the callback it is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import ray
from ray.exceptions import NodeDiedError, OutOfMemoryError, RayActorError, WorkerCrashedError

from orchestrator.cluster import interruptible

# What a call on a rank actor raises when its process is gone: killed (ActorDiedError), killed by
# Ray's memory monitor when the node runs low on memory (OutOfMemoryError: not a RayActorError,
# but the rank is just as dead, and host OOM is a common failure at scale), crashed or lost with
# its node. Each is a rank failure to recover from, never a controller error.
RANK_GONE = (RayActorError, OutOfMemoryError, WorkerCrashedError, NodeDiedError)

# The least time between two starts of one seat's actor: one that fails at once (its constructor
# raising) must not become a loop of process starts.
RETRY_S = 1.0


def pings_within(ranks: Iterable[int], actor_of: Callable[[int], object], recreate: Callable[[int], None],
                 timeout_s: float, interrupted: Callable[[], bool] = interruptible.never) -> dict[int, dict]:
    """The first ping of each of `ranks`' new actors (`actor_of(rank)`), waiting up to `timeout_s`
    in all. An actor that dies while starting is created again (`recreate(rank)`) and waited for
    within the same limit: one placed in a seat whose node was being lost is failed by Ray once
    the GCS declares the node dead, and the seat is re-placed on a live node where one has room,
    so the next one starts there. One dead at the limit is still re-created (the caller keeps it
    as a spare-to-be). Returns the pings of the ranks that came up; the rest are late."""
    deadline = time.monotonic() + timeout_s
    up: dict[int, dict] = {}
    waiting = list(ranks)
    while waiting:
        pings = {actor_of(rank).ping.remote(): rank for rank in waiting}
        ready, _ = interruptible.wait(list(pings), len(pings), max(0.0, deadline - time.monotonic()), interrupted)
        died = []
        for ref in ready:
            try:
                up[pings[ref]] = ray.get(ref)
            except RANK_GONE:
                died.append(pings[ref])
        for rank in died:
            recreate(rank)
        waiting = [rank for rank in waiting if rank not in up]
        if not died or deadline - time.monotonic() <= RETRY_S:
            break  # every one up, or the limit reached with some still starting, or no time to retry
        interruptible.sleep(RETRY_S, interrupted)
    return up
