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

# How often one seat's actor is started within one replacement: a death while starting is
# retried (its node was being lost, and Ray re-places the seat), but one whose constructor
# fails every time must not hold the recovery for the whole replace timeout.
STARTS = 3


def pings_within(ranks: Iterable[int], actor_of: Callable[[int], object], recreate: Callable[[int], None],
                 timeout_s: float, interrupted: Callable[[], bool] = interruptible.never) -> dict[int, dict]:
    """The first ping of each of `ranks`' new actors (`actor_of(rank)`), waiting up to `timeout_s`
    in all. An actor that dies while starting is created again (`recreate(rank)`) and, up to
    `STARTS` starts of its seat, waited for within the same limit: one placed in a seat whose node
    was being lost is failed by Ray once the GCS declares the node dead, and the seat is re-placed
    on a live node where one has room, so the next one starts there. The last one created is left
    alive for the caller (a spare-to-be). Returns the pings of the ranks that came up; the rest
    are late."""
    deadline = time.monotonic() + timeout_s
    starts = dict.fromkeys(ranks, 1)
    pings = {actor_of(rank).ping.remote(): rank for rank in starts}
    up: dict[int, dict] = {}
    while pings and (left := deadline - time.monotonic()) > 0:
        ready, _ = interruptible.wait(list(pings), 1, left, interrupted)
        for ref in ready:
            rank = pings.pop(ref)
            try:
                up[rank] = ray.get(ref)
            except RANK_GONE:
                recreate(rank)
                if starts[rank] < STARTS:
                    starts[rank] += 1
                    pings[actor_of(rank).ping.remote()] = rank
    return up
