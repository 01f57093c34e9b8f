"""The rank-side fault injector: slowness stays at its factor, faults fire once where asked."""

from __future__ import annotations

import time

import pytest

from chaos.injector import FaultInjector, InjectedFault


def _step(hook, step: int, work_s: float) -> float:
    started = time.perf_counter()
    hook("before_step", step)
    time.sleep(work_s / 2)
    hook("after_forward", step)
    time.sleep(work_s / 2)
    hook("after_backward", step)
    return time.perf_counter() - started


def test_slow_rank_stretches_compute_by_its_factor_without_compounding():
    hook = FaultInjector.hook_for([{"id": 0, "kind": "slow_rank", "rank": 0, "at_step": 2, "factor": 1.5}],
                                  0, lambda e: None)
    times = [_step(hook, s, 0.04) for s in range(8)]
    assert max(times[:2]) < 0.05  # not slow before at_step
    for t in times[3:]:  # from the step after at_step on: 1.5 x 0.04 s, steady
        assert 0.055 < t < 0.075, times


def test_faults_fire_only_for_their_rank_step_and_point():
    events = []
    hook = FaultInjector.hook_for([{"id": 7, "kind": "raise", "rank": 1, "at_step": 3, "message": "boom"}],
                                  1, events.append)
    assert FaultInjector.hook_for([{"id": 7, "kind": "raise", "rank": 1, "at_step": 3}], 0, events.append) is None
    for step in range(3):
        _step(hook, step, 0.0)
    with pytest.raises(InjectedFault, match="boom"):
        _step(hook, 3, 0.0)
    assert [(e["fault_id"], e["step"], e["point"]) for e in events] == [(7, 3, "after_backward")]
