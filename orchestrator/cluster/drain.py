"""Which Ray nodes are being drained, polled from the driver at a modest rate.

Ray announces that a node will go away by draining it: `ray drain-node` (with
`--deadline-remaining-seconds`), the autoscaler's scale-down, and spot or maintenance
notices that a cloud integration turns into a drain request all end in the GCS's drain
table. A draining node gets no new work from Ray's scheduler, and after its deadline
(epoch milliseconds, 0 for none) whoever drained it may terminate it. The GCS answers
`get_draining_nodes()` with `{node id hex: deadline ms}`; this module reads it through
`ray._private.state`, the same accessor Ray Train's preemption watcher uses (Ray 2.5x/2.60
has no public API for it).

Protocol: the controller calls `DrainWatcher.draining()` on every poll of its training
loop (controller thread only); the GCS is asked at most every `poll_s` seconds and the last
answer is returned in between. A failed query keeps the last answer (a GCS restart must not
look like every drain being cancelled) and is logged once per failure streak.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def gcs_draining_nodes() -> dict[str, int]:
    """`{node id hex: deadline epoch ms (0: none)}` from the GCS of the connected Ray cluster."""
    import ray._private.state

    return dict(ray._private.state.state.get_draining_nodes())


class DrainWatcher:
    def __init__(self, poll_s: float = 1.0, source: Callable[[], dict[str, int]] = gcs_draining_nodes,
                 clock: Callable[[], float] = time.monotonic):
        self.poll_s = poll_s
        self.source = source
        self.clock = clock
        self._asked_at: float | None = None
        self._nodes: dict[str, float | None] = {}
        self._failing = False

    def draining(self) -> dict[str, float | None]:
        """Nodes being drained: node id hex -> deadline (epoch seconds), None when it has none."""
        now = self.clock()
        if self._asked_at is not None and now - self._asked_at < self.poll_s:
            return self._nodes
        self._asked_at = now
        try:
            answer = self.source()
        except Exception as err:  # the GCS is restarting or unreachable: keep what we knew
            if not self._failing:
                log.warning("could not read Ray's draining nodes (%s: %s); keeping the last answer",
                            type(err).__name__, err)
            self._failing = True
            return self._nodes
        self._failing = False
        self._nodes = {node: (deadline_ms / 1000.0 if deadline_ms else None) for node, deadline_ms in answer.items()}
        return self._nodes
