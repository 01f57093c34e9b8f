"""The controller's long waits on Ray (orchestrator.cluster.interruptible) against a real cluster:
they give up within a slice of `interrupted()` saying yes, and otherwise behave as ray.wait and
ray.get do (a failed call raises its error at once, a slow one times out)."""

from __future__ import annotations

import time

import pytest

from orchestrator.cluster.interruptible import SLICE_S, Interrupted, get, wait

pytestmark = pytest.mark.ray


def test_waits_give_up_at_an_interruption_and_otherwise_act_as_ray(ray_cluster):
    import ray

    ray.init(address=ray_cluster, logging_level="ERROR")
    try:
        @ray.remote(num_cpus=0)
        def sleeps(seconds: float) -> float:
            time.sleep(seconds)
            return seconds

        @ray.remote(num_cpus=0)
        def fails() -> None:
            raise ValueError("a rank's restore failed")

        assert get([sleeps.remote(0.1), sleeps.remote(0.2)], 30) == [0.1, 0.2]
        for call in (lambda stop: get([sleeps.remote(60)], 120, stop),
                     lambda stop: wait([sleeps.remote(60)], 1, 120, stop)):
            until = time.monotonic() + 1.0
            with pytest.raises(Interrupted):
                call(lambda until=until: time.monotonic() > until)
            assert time.monotonic() - until < 3 * SLICE_S
        started = time.monotonic()
        with pytest.raises(ValueError, match="restore failed"):
            get([sleeps.remote(60), fails.remote()], 120)  # not after the slow one
        assert time.monotonic() - started < 10
        started = time.monotonic()
        with pytest.raises(ray.exceptions.GetTimeoutError):
            get([sleeps.remote(60)], 1.0)
        assert 1.0 <= time.monotonic() - started < 1.0 + 3 * SLICE_S
        ready, rest = wait([sleeps.remote(60)], 1, 1.0)
        assert ready == [] and len(rest) == 1
    finally:
        ray.shutdown()
