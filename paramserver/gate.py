"""A server's gate on pulls: where an injected worker kill lands, and how a stopped segment wakes the waiting pulls.

Protocol (paramserver.actors.ServerActor holds one, on its event loop; the supervisor,
paramserver.supervisor, drives it through the actor's methods):
  * `hold(worker, step)`, before the segment that contains `step` starts: that worker's pull of
    that step will wait at the gate. `held()` lists the pulls waiting there; the supervisor kills
    a held worker (or, once every worker is held at a server, that server), so the kill lands at
    one exact point: the worker has pushed every step before
    `step` to every server and nothing of `step` (its pushes are acknowledged before its next pull),
    so its clock is `step` on every server and a replacement resumes there exactly.
  * `drop(worker)`: that worker's waiting pull raises `PullDropped` (the worker is dead) and its
    armed holds are disarmed; `drop()` does so for every worker (the segment stops); the
    supervisor arms again for the next segment.
  * `drop_from(step)`: the holds of `step` and later are dropped, those before it kept (a segment
    cut short at `step`: the later ones are armed again for the next segment).
  * `SegmentStopped` is what an aborted server raises to a worker's pull or push
    (ServerActor.abort): the supervisor is rolling every server back to a checkpoint.
  * `SegmentCut` is what a cut server raises to a pull of the cut step or later (ServerActor.cut):
    the worker's run ends there, cleanly (paramserver.moves).
"""

from __future__ import annotations

import asyncio


class PullDropped(RuntimeError):
    """A pull held at the gate was dropped: its worker was killed, or the segment stopped."""


class SegmentStopped(RuntimeError):
    """The server was aborted: the supervisor stops the segment to restore every server."""


class SegmentCut(RuntimeError):
    """The segment was cut short at a step this pull is at or past: the worker's run ends here."""


class PullGate:
    def __init__(self) -> None:
        # (worker, step) -> None while armed, the event its held pull waits on once it arrived.
        self._holds: dict[tuple[int, int], asyncio.Event | None] = {}

    def hold(self, worker: int, step: int) -> None:
        self._holds.setdefault((worker, step), None)

    def held(self) -> list[tuple[int, int]]:
        return sorted(key for key, event in self._holds.items() if event is not None)

    async def wait(self, worker: int, step: int) -> None:
        """Return at once unless (worker, step) is armed; else wait until dropped, then raise."""
        key = (worker, step)
        if key not in self._holds:
            return
        event = self._holds[key] = asyncio.Event()
        await event.wait()
        raise PullDropped(f"worker {worker}'s pull of step {step} was held for an injected kill and dropped")

    def drop(self, worker: int | None = None) -> None:
        """Drop `worker`'s holds (None: every hold), held or only armed."""
        self._drop([key for key in self._holds if worker is None or key[0] == worker])

    def drop_from(self, step: int) -> None:
        """Drop the holds of `step` and later, held or only armed."""
        self._drop([key for key in self._holds if key[1] >= step])

    def _drop(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            event = self._holds.pop(key)
            if event is not None:
                event.set()
