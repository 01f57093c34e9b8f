"""What the new fault points cost when nothing fires there: in_allreduce (per DDP bucket) and the
controller's commit points and step intake (per commit, per step). Same method as
test_chaos_nan_grad's measurement: best of 5 x 100k calls, the bare loop subtracted."""

from __future__ import annotations

import time

import trainer.data_parallel as data_parallel
from ckpt.catalog import Catalog
from ckpt.storage import Storage
from orchestrator.controller.faults import ControllerFaults
from tests.unit.test_chaos_nan_grad import _engine, _loop_ns, _ns_per_call
from trainer.data_parallel import SyncClock, _timed_allreduce


def test_unarmed_in_allreduce_and_controller_points_cost_nothing_measurable(tmp_path, monkeypatch):
    # The comm hook as DDP calls it, per bucket, with the all-reduce itself stubbed out, so what is
    # timed is the hook's own work: the clock read and the fault point's test (None: no fault hook;
    # armed: a fault hook is set, but this step's first bucket has gone by).
    monkeypatch.setattr(data_parallel.default_hooks, "allreduce_hook", lambda group, bucket: None)
    unarmed = SyncClock()
    engine = _engine(fault_hook=lambda point, step: None)
    armed = engine._clock
    unarmed.group = armed.group = None  # wrap_ddp sets the dp group; the stub ignores it
    assert armed.in_flight is not None and engine._allreduce_step is None
    loop = _loop_ns()
    hook_none = max(0.0, _ns_per_call(lambda point, step: _timed_allreduce(unarmed, None)) - loop)
    hook_armed = max(0.0, _ns_per_call(lambda point, step: _timed_allreduce(armed, None)) - loop)
    # Without the point, the body would still read the clock and call the all-reduce: time that too.
    clock_only = max(0.0, _ns_per_call(lambda point, step: (time.perf_counter(), data_parallel.default_hooks
                                                            .allreduce_hook(None, None))) - loop)

    faults = ControllerFaults([], Catalog(Storage(f"file://{tmp_path}/ckpt/job")), 0, lambda: 0.0)
    commit_point = max(0.0, _ns_per_call(faults.at_point) - loop)
    step_intake = max(0.0, _ns_per_call(lambda point, step: faults.on_step(step)) - loop)

    plain = _engine(global_batch=2, micro_batch=2)
    plain.train_step()
    step_ns = float("inf")
    for _ in range(3):  # the fastest of three: load from other processes only makes steps slower
        started = time.perf_counter_ns()
        plain.train_step()
        step_ns = min(step_ns, time.perf_counter_ns() - started)
    print(f"\nin_allreduce unarmed: comm hook body {hook_none:.0f} ns/bucket without a fault hook "
          f"({clock_only:.0f} ns of it is the clock read and the call), {hook_armed:.0f} ns/bucket with one "
          f"armed for another step; controller points: {commit_point:.0f} ns/commit, step intake "
          f"{step_intake:.0f} ns/step; a tiny step takes {step_ns / 1e6:.2f} ms")
    # Per step: a handful of buckets and one step intake; per commit: two points. The hook bodies
    # are upper bounds of the points' cost (they include the clock read and the stubbed call).
    assert 8 * max(hook_none, hook_armed) + step_intake + 2 * commit_point < 0.01 * step_ns
