"""One restore at a time in a rank's process, the latest call winning.

Why: the controller stops waiting for a restore as soon as one rank's call fails (a damaged
checkpoint, a rank that died), and then either calls `restore` again at once with another
source (the previous checkpoint, storage instead of memory) or forms a new generation, whose
`join` and `restore` follow. The other ranks' first calls are still loading meanwhile: the actor
runs calls on several threads (so `ping` answers), and nothing would stop a second restore from
building a second engine beside the first, which on a GPU is two copies of the rank's share of the
model and its optimizer state; and the slower of the two could publish its engine last.

Protocol (orchestrator.rank.actor.RankActor): `restore` takes a ticket with `begin()` and does its
work inside `turn(ticket)`, which waits for any earlier restore to end; it calls `check(ticket)`
between pieces of work (before building the engine, as each piece of the checkpoint is read and
between a read's retries) and publishes its engine with `publish(ticket, ...)`, atomic with
`supersede`. `leave` (a new generation's `join`) calls `supersede()`, breaks the process group (a
stale restore's collective fails at once), then drops the engine and collects, freezing only when
`quiet(wait_s)` finds no restore running (one still inside holds an engine; the next restore's
collection, in its turn, freezes). A stale restore still inside after the controller's `leave`
waited, and silent (no check) for `STUCK_S`, is stuck in a read that never answers (its thread,
and the turn, are freed only by the process's end): `leave` says the rank cannot take part, so the
controller replaces it. One busy where no check runs (building the engine, the load after the last
piece) is not judged: the next restore waits its turn, and a later `leave` judges again.
A stale restore raises RestoreSuperseded at its next check,
dropping its engine, and the controller, which no longer waits for that call, never sees it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ckpt.errors import ReadAbandoned

# No check for this long inside a restore: a read that never answers. Well above the time a piece of
# ckpt.fetch (16 MiB) takes, or an engine's build, on a working store and device.
STUCK_S = 120.0


class RestoreSuperseded(ReadAbandoned):
    """A restore given up because a later restore call, or a new generation, came to this rank."""


class RestoreTurns:
    def __init__(self) -> None:
        self._turn = threading.Lock()  # held by the one restore working
        self._latest = 0  # the ticket of the latest restore call (or supersede)
        self._tickets = threading.Lock()
        self._progress_at = time.monotonic()  # the last check (or turn taken) of a restore: its progress

    def silent_s(self) -> float:
        """Seconds since a restore last took its turn or made a check: how long the one inside has shown
        no progress (a read that never answers shows none, ever)."""
        return time.monotonic() - self._progress_at

    def begin(self) -> int:
        """A new restore call's ticket; every earlier restore is stale from now on."""
        return self.supersede()

    def supersede(self) -> int:
        """Make every restore running now stale (a new generation is joining)."""
        with self._tickets:
            self._latest += 1
            return self._latest

    def stale(self, ticket: int) -> bool:
        """Whether a later call (a restore, a `leave`'s supersede) has come since `ticket` was taken."""
        return ticket != self._latest

    def check(self, ticket: int) -> None:
        """Raise RestoreSuperseded when a later call has come since `ticket` was taken."""
        self._progress_at, latest = time.monotonic(), self._latest
        if ticket != latest:
            raise RestoreSuperseded(f"restore call {ticket} superseded by a later one ({latest}) on this rank")

    def publish(self, ticket: int, publish: Callable[[], None]) -> None:
        """`publish()` unless `ticket` is stale (then RestoreSuperseded), atomically with `supersede`:
        a restore that a `leave` made stale never publishes after that `leave` dropped the engine."""
        with self._tickets:
            self.check(ticket)
            publish()

    @contextmanager
    def quiet(self, wait_s: float = 0.0) -> Iterator[bool]:
        """Holds the turn once no restore runs, waiting at most `wait_s` for one inside to end; yields
        whether it did (False: a restore is still inside, e.g. a stale one whose read has not answered)."""
        held = self._turn.acquire(timeout=wait_s) if wait_s > 0 else self._turn.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                self._turn.release()

    @contextmanager
    def turn(self, ticket: int) -> Iterator[None]:
        """Run the restore of `ticket` alone: waits until an earlier restore has given up (at its
        next check) or ended; raises RestoreSuperseded when `ticket` went stale meanwhile."""
        with self._turn:
            self.check(ticket)  # (its progress clock starts here)
            yield
