"""nan_grad in a real single-process engine, and what an unarmed fault point costs."""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch

from chaos.injector import FaultInjector
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import FAULT_POINTS, Engine


def _engine(fault_hook=None, **train) -> Engine:
    cfg = TrainConfig(**{"steps": 20, "global_batch": 8, "micro_batch": 2, "lr": 1e-3, **train})
    return Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=32), cfg, ParallelConfig(), rank=0, world_size=1,
                  fault_hook=fault_hook)


def _nan_in_grads(module) -> bool:
    return any(p.grad is not None and torch.isnan(p.grad).any() for p in module.parameters())


def _watching(engine: Engine, injector_hook, seen: dict):
    """The injector's hook, then a look at the gradients it left (the engine clips and steps next)."""

    def hook(point: str, step: int) -> None:
        if injector_hook is not None:
            injector_hook(point, step)
        if point == "after_backward":
            seen[step] = _nan_in_grads(engine.model)

    return hook


def test_armed_nan_grad_poisons_that_step_only():
    events, seen = [], {}
    engine = _engine()
    hook = FaultInjector.hook_for([{"id": 4, "kind": "nan_grad", "rank": 0, "at_step": 1}], 0, events.append,
                                  target=engine.model)
    engine.fault_hook = _watching(engine, hook, seen)
    results = [engine.train_step() for _ in range(2)]
    assert seen == {0: False, 1: True}
    assert math.isfinite(results[0].grad_norm) and math.isnan(results[1].grad_norm)
    assert any(torch.isnan(p).any() for p in engine.model.parameters())  # the update wrote NaN weights
    assert [(e["fault_id"], e["kind"], e["step"], e["point"]) for e in events] == [(4, "nan_grad", 1, "after_backward")]


def test_unarmed_nan_grad_changes_nothing():
    reference = _engine()
    for _ in range(3):
        reference.train_step()
    seen = {}
    engine = _engine()
    # Armed for a step this run never reaches: the hook runs at every point and must not touch anything.
    injector = FaultInjector([{"id": 0, "kind": "nan_grad", "rank": 0, "at_step": 99}], 0, lambda e: None)
    injector.set_target(engine.model)
    engine.fault_hook = _watching(engine, injector.hook, seen)
    for _ in range(3):
        engine.train_step()
    assert seen == {0: False, 1: False, 2: False}
    for name, value in reference.state_tensors().items():
        assert torch.equal(engine.state_tensors()[name], value), name
    # Another rank's fault: no hook at all for this rank.
    assert FaultInjector.hook_for([{"id": 0, "kind": "nan_grad", "rank": 1, "at_step": 0}], 0, print) is None


def test_nan_grad_without_target_or_gradient_says_how_to_fix():
    engine = _engine()
    engine.fault_hook = FaultInjector.hook_for([{"id": 0, "kind": "nan_grad", "rank": 0, "at_step": 0}], 0,
                                               lambda e: None)
    with pytest.raises(RuntimeError, match="set_target"):
        engine.train_step()
    early = _engine()
    early.fault_hook = FaultInjector.hook_for(
        [{"id": 0, "kind": "nan_grad", "rank": 0, "at_step": 0, "at_point": "before_step"}], 0, lambda e: None,
        target=early.model)
    with pytest.raises(RuntimeError, match="use at_point: after_backward"):
        early.train_step()


def _ns_per_call(hook, calls: int = 100_000, repeats: int = 5) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter_ns()
        for step in range(calls):
            hook("after_backward", step)
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def _loop_ns(calls: int = 100_000, repeats: int = 5) -> float:
    """The bare loop's cost, so that the hook's own cost is what remains."""
    return _ns_per_call(lambda point, step: None, calls, repeats)


def test_unarmed_fault_point_costs_nothing_measurable():
    empty = FaultInjector([], 0, lambda e: None)
    later = FaultInjector([{"id": 0, "kind": "nan_grad", "rank": 0, "at_step": 10**9}], 0, lambda e: None)
    loop = _loop_ns()
    empty_ns = max(0.0, _ns_per_call(empty.hook) - loop)
    later_ns = max(0.0, _ns_per_call(later.hook) - loop)

    # End to end: the tiny engine's step with no hook against the same step with an unarmed injector.
    plain, hooked = _engine(global_batch=2, micro_batch=2), _engine(global_batch=2, micro_batch=2)
    hooked.fault_hook = empty.hook
    times: dict[str, list[float]] = {"none": [], "injector": []}
    for _ in range(2):  # warm-up
        plain.train_step(), hooked.train_step()
    for _ in range(12):  # interleaved, so load from other processes hits both alike
        for name, engine in (("none", plain), ("injector", hooked)):
            started = time.perf_counter_ns()
            engine.train_step()
            times[name].append(time.perf_counter_ns() - started)
    step_ns = min(times["none"])
    per_step_ns = len(FAULT_POINTS) * max(empty_ns, later_ns)
    print(f"\nunarmed hook: {empty_ns:.0f} ns/call (no faults), {later_ns:.0f} ns/call (one fault for a later "
          f"step); {len(FAULT_POINTS)} calls/step = {per_step_ns:.0f} ns = {100 * per_step_ns / step_ns:.4f}% of "
          f"a tiny step ({step_ns / 1e6:.2f} ms); train_step median {statistics.median(times['none']) / 1e6:.3f} ms "
          f"without hook, {statistics.median(times['injector']) / 1e6:.3f} ms with")
    assert per_step_ns < 0.01 * step_ns
    # Generous: an end-to-end difference this size would be a real cost, not noise of the min.
    assert min(times["injector"]) < 1.25 * step_ns
