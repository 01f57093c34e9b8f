"""Reading a worker's stream of step logs (WorkerActor.run, a Ray streaming generator) without blocking.

Called by the supervisor's loop (paramserver.supervisor) every poll: `take(stream)` returns the
logs that are ready, and once the stream has ended, its error (None when the run finished);
`actor_died(error)` tells a dead worker actor from a run that raised (a call to a dead server).
When a segment stops, `stop_all` takes every stream to its end and `dead_servers` finds the
servers that died.
`arm_holds` and `drop_holds` place and remove the pull holds of injected faults (paramserver.gate)
and wait until the servers have them; `held_pulls` says which are held now, and `fire_held` fires
the faults whose pulls are held.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from paramserver.actors import StepLog
from paramserver.recovery import Fault, FaultPlan

log = logging.getLogger(__name__)


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


def dead_servers(servers: list, timeout_s: float = 30.0) -> set[int]:
    """The indices of `servers` whose actor is dead or does not answer a progress call in `timeout_s`.
    Every server is asked at once, so a job with many servers, some hung, waits `timeout_s` once."""
    calls = {server.progress.remote(): k for k, server in enumerate(servers)}
    if not calls:
        return set()
    answered, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    dead = {k for call, k in calls.items() if call not in answered}
    for call in answered:
        try:
            ray.get(call)
        except RayActorError:
            dead.add(calls[call])
    return dead


def stop_all(streams: dict, on_log: Callable[[StepLog], None], within_s: float, kill: Callable[[int], None],
             poll_s: float) -> set[int]:
    """After the servers were aborted (their waiting calls fail): take every worker's logs, looking
    every `poll_s`, until its stream ends, killing (`kill(w)`) a worker whose stream has not ended
    within `within_s`; empties `streams` and returns the workers whose actor died."""
    died: set[int] = set()
    deadline = time.time() + within_s
    while streams:
        ray.wait(list(streams.values()), num_returns=1, timeout=poll_s)
        for w, stream in list(streams.items()):
            logs, error, ended = take(stream)
            for entry in logs:
                on_log(entry)
            if ended:
                del streams[w]
                if error is not None and actor_died(error):
                    died.add(w)
        if time.time() > deadline:
            for w in streams:
                log.warning("worker %d did not stop %.0f s after the servers were aborted; killing it", w, within_s)
                kill(w)
            deadline = math.inf
    return died


HOLD_S = 30.0  # how long placing or dropping holds may take (a dead server is left to the polls)


def arm_holds(servers: list, holds: list[tuple[int, int, int]]) -> None:
    """Hold the pulls `holds` [(server, worker, step)] and wait until the servers have them: a pull
    is the worker's call, which Ray may run on the server before the supervisor's, and a pull that
    passed before its hold was placed would never fire its fault, silently."""
    with contextlib.suppress(RayActorError, GetTimeoutError):
        ray.get([servers[k].hold.remote(worker, step) for k, worker, step in holds], timeout=HOLD_S)


def held_pulls(servers: list, asked: dict[int, object], armed: set[int]) -> dict[int, list]:
    """{server: the pulls held there} for each server of `armed` whose `held` call has answered;
    `asked` (server -> its outstanding call, kept by the caller across polls) is asked again next
    poll. A dead server is left out: its progress poll reports it."""
    answered = {}
    for k in sorted(armed):
        if k not in asked:
            asked[k] = servers[k].held.remote()
        if not ray.wait([asked[k]], timeout=0)[0]:
            continue
        with contextlib.suppress(RayActorError):
            answered[k] = ray.get(asked.pop(k))
    return answered


def drop_holds(servers: list, worker: int) -> None:
    """Drop dead `worker`'s held pull and holds on every server, and wait for it (holds armed next
    for its replacement must not be dropped by a late drop)."""
    with contextlib.suppress(RayActorError, GetTimeoutError):
        ray.get([server.drop_held.remote(worker) for server in servers], timeout=HOLD_S)


def fire_held(plan: FaultPlan, servers: list, workers: list, asked: dict[int, object], start: int,
              end: int) -> list[Fault]:
    """Fire the faults of segment [start, end) whose pulls are held now (`asked`: as held_pulls'): kill
    the worker or the server, or stop it (a hang: its process stops itself, wherever it runs, and the
    hang watchdog finds it); the faults fired."""
    fired = []
    armed = {server for server, _, _ in plan.holds(start, end, len(workers))}
    for k, held in held_pulls(servers, asked, armed).items():
        for fault_id in plan.due(k, held, start, end, len(workers)):
            fault = plan.fire(fault_id)
            actor = (workers if fault.actor == "worker" else servers)[fault.target]
            if fault.hang:
                actor.hang.remote()
            else:
                ray.kill(actor, no_restart=True)
            fired.append(fault)
    return fired
