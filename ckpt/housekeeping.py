"""Store work off the controller's thread: retention, GC, the goodput snapshot, manifest creates.

The controller is single-threaded: while it waits on the store it notices no dead rank, no hang
and no signal. Retention and GC after a commit list the job's root, stat the manifests and delete
whole step directories (a thousand shard objects each at a thousand ranks), the goodput snapshot
is rewritten every few seconds, and a commit creates its manifest: on a slow or throttling store
that is seconds to minutes per call, and a failure during them would be noticed only after. None
of it needs the controller's thread, so a `Housekeeper` runs it on one background thread (the
committer's creates on one of their own, whose outcomes the controller collects: ckpt.commit).

Protocol: the owner (ckpt.commit.Committer for retention and GC and for its manifest creates, the
controller's LedgerSnapshots for the snapshot) calls `submit(work)`; work not yet started when a
newer one is submitted is dropped, since the newer does the same with newer inputs (the newest
commit's retention, the newest snapshot, the newest complete save's create), so a slow store
never builds a queue. `discard()` drops queued
work (a new generation: a GC planned for the last one must not run against this one's saves).
`settle(timeout_s)` waits until nothing is queued or running, at most that long, and says whether
it did: the owner calls it before work whose outcome depends on it (a restore's listing), and
`close(timeout_s)` at the run's end, which settles and then ends the thread (work submitted later
starts another). Work handles the store's
errors itself (it is best effort, and logs); anything it raises is logged with its traceback.

A pass planned for one generation must not outlive it: its GC takes the step directories below the
commit it followed for orphans, and a new generation restored from an older step saves there. So
the committer runs it against a Catalog whose fence is a `PassFence`: before each deletion it
raises `Superseded` once a new generation began (and checks the owner lease as ever); only the
deletion under way when the generation changes completes, and a new generation's first save comes
a restore and a step later.

Its own thread, a daemon, not concurrent.futures: an executor's workers are joined at interpreter
exit, and a store call hung on a dead endpoint would hold the driver's exit (a preemption's
grace) for the client's timeouts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Housekeeper:
    def __init__(self, name: str):
        self.name = name
        self._changed = threading.Condition()
        self._queued: Callable[[], None] | None = None
        self._running = False
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> Callable[[], None] | None:
        """Run `work` on the background thread, in place of any work still queued; the work it replaced."""
        with self._changed:
            replaced, self._queued, self._closing = self._queued, work, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._changed.notify_all()
        return replaced

    def discard(self) -> None:
        """Drop the queued work, if any (the running one finishes)."""
        with self._changed:
            self._queued = None
            self._changed.notify_all()

    def settle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running, at most `timeout_s`; whether it is so now."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._queued is not None or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def close(self, timeout_s: float) -> bool:
        """`settle`, then let the thread end once idle (a pass still running finishes first)."""
        settled = self.settle(timeout_s)
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        return settled

    @property
    def busy(self) -> bool:
        with self._changed:
            return self._queued is not None or self._running

    def _loop(self) -> None:
        while True:
            with self._changed:
                while self._queued is None:
                    if self._closing:
                        self._thread = None
                        return
                    self._changed.wait()
                work, self._queued, self._running = self._queued, None, True
            try:
                work()
            except BaseException:  # a bug in the work: logged, the thread serves the next
                log.exception("%s: background store work failed", self.name)
            finally:
                work = None  # nothing it holds (a catalog, a snapshot) outlives it here
                with self._changed:
                    self._running = False
                    self._changed.notify_all()


class Superseded(Exception):
    """A background pass stopped at its fence: what it was planned against is gone (a new generation)."""


class PassFence:
    """What a background pass's Catalog checks before each deletion (ckpt.catalog.Catalog.fence): that
    `current()` still holds, else Superseded, then the owner lease (OwnershipLost, OwnershipUncertain)."""

    def __init__(self, owner, current: Callable[[], bool]):
        self.owner, self.current = owner, current

    def check(self) -> None:
        if not self.current():
            raise Superseded("a new generation began after the commit this pass followed")
        if self.owner is not None:
            self.owner.check()
