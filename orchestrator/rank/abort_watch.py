"""A rank's abort watcher: the controller's abort key breaks the rank's own blocked collective.

Protocol: `RankActor.train` starts `watch_abort` on a thread of its own for each generation, with
that generation's objects: the store connection it polls, the event that says the generation's
`train` is over, the rank loop's abort event and the generation's process-group sockets. All four
are the generation's own (`join` makes a new abort event), so a watcher still inside a store
round trip when its generation ends can only ever touch that generation, never the next one.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the abort key is read
RETRY_S = 1.0  # after a failed read: the store may be loaded (a thousand ranks re-joining) or gone


def watch_abort(store, training_over: threading.Event, abort: threading.Event, sockets) -> None:
    """Until `training_over`: when the store says the controller asked for an abort, set `abort`
    (the rank loop stops at its next check) and shut the generation's `sockets` (a collective
    blocked on a dead peer fails at once). A failed read is logged once and retried every
    RETRY_S: giving up would leave the rank to the collective timeout for the whole generation,
    and on NCCL a dead peer need not fail any socket, so the release would kill it as hung."""
    failing, wait_s = False, POLL_S
    while not training_over.wait(wait_s):
        try:
            requested = store.abort_requested()
        except Exception as err:  # noqa: BLE001 (any store failure: retried until the generation ends)
            if not failing:
                log.warning("abort watcher: the controller's store did not answer (%s: %s); retrying every %.0f s",
                            type(err).__name__, err, RETRY_S)
            failing, wait_s = True, RETRY_S
            continue
        failing, wait_s = False, POLL_S
        if requested and not training_over.is_set():
            abort.set()
            if sockets is not None:
                sockets.abort()
            return
