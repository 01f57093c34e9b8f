"""New actors coming up (orchestrator.cluster.new_actors.pings_within) against a real cluster: one that
dies while starting is started again in its seat, a few times at most, and waited for within the one
limit; the others' pings come back as they answer, not after the slowest."""

from __future__ import annotations

import time

import pytest

from orchestrator.cluster.new_actors import STARTS, pings_within

pytestmark = pytest.mark.ray


def test_a_death_while_starting_is_retried_a_few_times_then_left_late(ray_cluster):
    import ray

    ray.init(address=ray_cluster, logging_level="ERROR")
    try:
        @ray.remote(num_cpus=0, max_restarts=0)
        class Seat:
            def __init__(self, fail: bool):
                if fail:
                    raise RuntimeError("no device in this seat")

            def ping(self) -> dict:
                return {"node": ray.get_runtime_context().get_node_id()}

        broken_starts = []

        def recreate(rank: int) -> None:
            broken_starts.append(rank)
            actors[rank] = Seat.remote(rank == 1)

        actors = {0: Seat.remote(False), 1: Seat.remote(True)}
        started = time.monotonic()
        up = pings_within([0, 1], actors.__getitem__, recreate, timeout_s=120)
        assert list(up) == [0] and up[0]["node"]
        assert broken_starts == [1] * STARTS  # every death re-created, the last one left for the caller
        assert time.monotonic() - started < 60  # given up after its starts, not at the 120 s limit
    finally:
        ray.shutdown()
