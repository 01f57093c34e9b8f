"""Reading a worker's stream of step logs (WorkerActor.run, a Ray streaming generator) without blocking.

Called by the supervisor's loop (paramserver.supervisor) every poll: `take(stream)` returns the
logs that are ready, and once the stream has ended, its error (None when the run finished);
`actor_died(error)` tells a dead worker actor from a run that raised (a call to a dead server).
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError, RayTaskError

from paramserver.actors import StepLog


def take(stream) -> tuple[list[StepLog], BaseException | None, bool]:
    """The logs `stream` has ready, without blocking; whether it ended, and with which error."""
    logs: list[StepLog] = []
    while True:
        ended = bool(ray.wait([stream.completed()], timeout=0)[0])
        if not ended and not ray.wait([stream], timeout=0)[0]:
            return logs, None, False
        try:
            ref = next(stream)
        except StopIteration:
            return logs, None, True
        try:
            logs.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 (the stream's end: the actor died, or its run raised)
            return logs, err, True


def actor_died(error: BaseException) -> bool:
    """The worker's own actor died (not a call of its run to a dead server, which Ray wraps in a
    RayTaskError that is also an instance of the cause)."""
    return isinstance(error, RayActorError) and not isinstance(error, RayTaskError)


def brief(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
