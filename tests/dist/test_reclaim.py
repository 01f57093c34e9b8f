"""A surviving rank frees a finished generation's engine at once (orchestrator/rank/reclaim.py).

Four gloo ranks go through three generations as rank actors do: form a process group under a
new store prefix, build a dp 2 x pp 2 engine (DDP with ZeRO-1 inside a 1F1B pipeline: the
cycles of DDP's reducer, the pipeline runner and the data cursor all there), train two steps,
then leave (abort the sockets, destroy the groups, drop the engine). Without a collection the
engine's model (its weights) outlives its generation, and its process groups' threads with it; after
`reclaim_generation()` the model is gone and the thread count is the same every generation.
"""

from __future__ import annotations

import gc
import os
import weakref
from datetime import timedelta

import pytest
import torch.distributed as dist

from orchestrator.rank.comm_abort import CommSockets
from orchestrator.rank.reclaim import reclaim_generation
from tests.dist._launch import free_port, run_ranks
from tests.dist.test_engine_3d import DATA, MODEL, TRAIN, par
from trainer.engine import Engine
from trainer.topology import Topology, build_mesh

pytestmark = pytest.mark.dist

GENERATIONS = 3


def generations(rank, world_size, port, reclaim):
    """Per generation: (threads of this process, whether its model's first weight is alive) after
    leaving it."""
    if not reclaim:  # no collection at all: an automatic one (its timing depends on what ran before) would free some
        gc.disable()
    base = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=60))
    dist.destroy_process_group()  # the launcher's; each generation forms its own, as a rank actor does
    out = []
    for gen in range(GENERATIONS):
        with CommSockets.capture() as sockets:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}", base), rank=rank,
                                    world_size=world_size)
        parallel = par(dp=2, pp=2, zero=1, schedule="1f1b")
        with sockets.adding():
            mesh = build_mesh(Topology.of(parallel), "cpu")
        engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size, mesh=mesh)
        engine.train_step()
        engine.train_step()
        weight = weakref.ref(next(iter(engine.model.parameters())))
        sockets.abort()
        dist.destroy_process_group()
        # wait: a prefetch load still finishing would be counted as this generation's thread (the actor
        # does not wait; the thread ends with its load, so it does not pile up either way)
        engine.data.close(wait=True)
        del engine, mesh
        if reclaim:
            reclaim_generation()
        out.append((len(os.listdir("/proc/self/task")), weight() is not None))
    gc.unfreeze()
    gc.enable()
    # The launcher ends with a barrier on a default group.
    dist.init_process_group("gloo", store=dist.PrefixStore("end", base), rank=rank, world_size=world_size)
    return out


def test_a_dropped_engine_lives_on_in_cycles_until_a_collection():
    for per_gen in run_ranks(generations, 4, (free_port(), False), timeout_s=600):
        assert all(alive for _, alive in per_gen), per_gen
        assert per_gen[-1][0] > per_gen[0][0], per_gen  # the old groups' threads pile up


def test_reclaim_frees_each_generation_and_the_threads_stay_flat():
    for per_gen in run_ranks(generations, 4, (free_port(), True), timeout_s=600):
        assert not any(alive for _, alive in per_gen), per_gen
        assert len({threads for threads, _ in per_gen}) == 1, per_gen
