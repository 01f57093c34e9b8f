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
    injector = FaultInjector([{"id": 0, "kind": "slow_rank", "rank": 0, "at_step": 2, "factor": 1.5}], 0,
                             lambda e: None)
    times, slept, compute = [], [], []
    for s in range(8):
        times.append(_step(injector.hook, s, 0.04))
        slept.append(injector._slept)
        compute.append(injector._last_compute)
    # Load on the machine only makes sleeps longer, so lower bounds and the injector's own accounting
    # are what can be checked without flaking: no sleep before at_step; from then on each step sleeps
    # (factor - 1) x the previous step's compute, and that compute excludes the injected sleep (a
    # compounding straggler would count its own sleep as compute and slow down further every step).
    assert slept[:2] == [0.0, 0.0]
    for k in range(2, 8):
        assert slept[k] == pytest.approx(0.5 * compute[k - 1]), (slept, compute)
        assert 0.04 <= compute[k] <= times[k] - slept[k] + 1e-3, (times, slept, compute)
        assert times[k] >= 1.5 * 0.04 * 0.99, times


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


@pytest.mark.parametrize(("fault", "delayed_steps"), [
    ({"at_step": 0}, []),  # the job's first step only: an injector that starts at step 2 never delays
    ({"at_step": 3}, [3]),  # a restored generation that starts past at_step is not delayed
    ({"at_point": "after_forward"}, [2]),  # no at_step: each generation's first step (this one starts at 2)
    ({"at_step": 3, "repeat": True}, [3, 4, 5]),
])
def test_slow_rank_with_delay_s_delays_the_steps_it_names_by_a_fixed_time(monkeypatch, fault, delayed_steps):
    injector = FaultInjector([{"id": 0, "kind": "slow_rank", "rank": 0, "delay_s": 60, **fault}], 0,
                             lambda e: pytest.fail("a slow step sends no notice"))
    sleeps: list[tuple[int, float]] = []
    for s in range(2, 6):
        monkeypatch.setattr(time, "sleep", lambda seconds, s=s: sleeps.append((s, seconds)) if seconds else None)
        _step(injector.hook, s, 0.0)
    assert sleeps == [(s, 60.0) for s in delayed_steps]


def test_a_kill_node_that_finds_no_raylet_to_kill_raises_before_any_notice_says_it_fired(monkeypatch):
    import os

    notices: list[dict] = []
    injector = FaultInjector([{"id": 0, "kind": "kill_node", "rank": 0, "at_step": 1, "at_point": "after_backward"}],
                             0, notices.append)
    monkeypatch.setattr("chaos.injector.os.getppid", os.getpid)  # this process's parent is no raylet here
    with pytest.raises(RuntimeError, match="not the node's raylet; nothing was killed"):
        injector.hook("after_backward", 1)
    assert notices == []  # no node kill is reported as tested
