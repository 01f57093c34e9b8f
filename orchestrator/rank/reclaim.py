"""Reclaiming a finished generation's engine at once, in a rank process that outlives many.

A rank actor survives failures: it leaves the broken generation, joins the next one and builds
a new engine, while its old engine sits in reference cycles (DDP and its reducer, the pipeline
runner and its stages, the data cursor and its prefetch thread pool). Reference counting never
frees those; only a full collection does, and the interpreter runs one when it sees fit. Until
then a survivor holds the previous generations' models, gradient buckets and process groups
beside the new ones: on a GPU, two models' memory at the restore that builds the second; on
CPU, 6 more threads per generation in a dp 2 x pp 2 rank (tests/dist/test_reclaim.py), and 50
to 80 threads in the survivors of a chaos run.

A full collection scans every tracked object, and a process that imported torch has ~300k of
them: 0.25-0.47 s per collection on a loaded 2-core host, too long for a recovery that takes
0.35 s. So what is alive between generations (the imports, the actor's own state) is moved out
of the collector's sight with `gc.freeze()` after each collection, and the next collection scans
only what one generation created: 4-21 ms on the same host.

Protocol: the rank actor calls `reclaim_generation()` with no engine alive: on a thread of its
own when its generation aborts (it returns from `train` at once, and the collection overlaps the
controller's detection and placement), when it leaves a generation and before `restore` builds
the next engine (each waiting for that thread first), and at the end of a spare's warm-up (its
throwaway engine). Never freezing with an engine alive: a frozen engine would never be collected.
So the actor hands over weak references to the engines it dropped and to each generation's
checkpoint writers (`dropped`): a thread of the old generation may still reach one (a save left to
finish after an abort holds the rank loop through its callbacks, and its writer its staging copy
and store client, frozen for good were it frozen while alive; a data read in flight holds the
cursor's), and while any is alive this collection only collects; a later one, once those threads
have ended, freezes.
"""

from __future__ import annotations

import gc
import weakref


def reclaim_generation(freeze: bool = True, dropped: tuple[weakref.ref, ...] = ()) -> bool:
    """Collect what the dropped engines left in cycles, then freeze what is still alive; returns
    whether it froze. `freeze` False when an engine may still be alive (a stale restore that has
    not given up yet); `dropped`: weak references to engines dropped earlier: no freeze while one
    of them is still alive after the collection."""
    gc.collect()
    if not freeze or any(ref() is not None for ref in dropped):
        return False
    gc.freeze()
    return True
