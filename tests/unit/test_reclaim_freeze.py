"""A collection freezes what survives it only when no engine dropped earlier is still reachable: a
thread of the old generation (a save left to finish after an abort, a data read in flight) may
still hold one, and an engine frozen then would never be collected once the thread ends."""

from __future__ import annotations

import gc
import weakref

from orchestrator.rank.reclaim import reclaim_generation


class _Engine:
    """Stands for an engine: it lives in reference cycles (DDP's reducer, the pipeline runner)."""

    def __init__(self):
        self.me = self


def test_no_freeze_while_a_dropped_engine_is_reachable_and_it_is_collected_once_released():
    engine = _Engine()
    late_save = [engine]  # the rank loop, reached from a writer thread still running
    dropped = (weakref.ref(engine),)
    del engine
    try:
        assert reclaim_generation(dropped=dropped) is False and dropped[0]() is not None
        late_save.clear()  # the save finished: its thread let go
        assert reclaim_generation(dropped=dropped) is True and dropped[0]() is None
    finally:
        gc.unfreeze()
