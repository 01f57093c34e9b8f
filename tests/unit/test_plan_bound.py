"""The step time `undying plan` ranks by is a lower bound: each term charges only what the
engine must do.

  * ZeRO 2/3 (FSDP2): gradients are reduce-scattered once per microbatch without a pipeline
    (so that they stay sharded while they accumulate) and once per step inside one (torch's
    stages reduce after the schedule), weights gathered as often as FSDP2 must gather them;
  * the pipeline bubble: no GPipe or 1F1B run of stages with any (uneven) times beats
    `pipeline_bound`, checked against an event-by-event run of both schedules.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._fuzz import fuzz
from trainer.config import ModelConfig
from trainer.costmodel import hardware, predict, stage_params
from trainer.costmodel.layout import Layout, Workload
from trainer.costmodel.memory import LOW_PRECISION_BYTES
from trainer.costmodel.time import group_link, pipeline_bound, ring_allgather_seconds

H100 = hardware("h100")
SMALL = ModelConfig(preset="small")


@pytest.mark.parametrize(("zero", "pp", "gathers"), [
    (2, 1, lambda m: (m, m)),  # each microbatch's forward gathers; its backward reshards
    (3, 1, lambda m: (2 * m, m)),  # ...and the blocks regather for backward; the root unit does not
    (2, 2, lambda m: (1, 1)),  # a pipeline stage keeps its weights gathered until the last backward
    (3, 2, lambda m: (m, 1)),
])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_reduces_gradients_as_the_engine_does(zero, pp, gathers, precision):
    work = Workload(SMALL, 1024, 64, precision)
    layout = Layout(dp=4, pp=pp, zero=zero, micro_batch=2, schedule="gpipe")
    m = layout.microbatches(work.global_batch)
    params = stage_params(SMALL, layout, pp - 1, 1024)
    alpha, bandwidth = group_link(H100, layout, "dp")
    blocks, others = gathers(m)
    gathered = LOW_PRECISION_BYTES[precision] * (blocks * params.block_params + others * params.other_params)
    reduced = 4 * params.total * (m if pp == 1 else 1)  # fp32: the engine's reduce dtype
    expected = (ring_allgather_seconds(gathered, 4, alpha, bandwidth)
                + ring_allgather_seconds(reduced, 4, alpha, bandwidth))
    prediction = predict(work, layout, H100)
    assert m == 8
    assert prediction.comm_s - prediction.exposed_comm_s == pytest.approx(expected)


def run_pipeline(forward: list[int], backward: list[int], m: int, schedule: str) -> int:
    """Makespan of GPipe or 1F1B with these per-stage microbatch times (all ranks synchronous:
    a forward waits for the previous stage's forward, a backward for the next stage's)."""
    p = len(forward)
    order = []
    for s in range(p):
        if schedule == "gpipe":
            ops = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        else:
            warm = min(p - s - 1, m)
            ops = [("F", j) for j in range(warm)]
            for j in range(m - warm):
                ops += [("F", warm + j), ("B", j)]
            ops += [("B", j) for j in range(m - warm, m)]
        order.append(ops)
    done: dict[tuple[str, int, int], int] = {}
    free, cursor = [0] * p, [0] * p
    while any(cursor[s] < len(order[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if cursor[s] == len(order[s]):
                continue
            kind, j = order[s][cursor[s]]
            needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs = [("F", s, j)] + ([("B", s + 1, j)] if s < p - 1 else [])
            if all(need in done for need in needs):
                start = max([free[s]] + [done[need] for need in needs])
                free[s] = done[(kind, s, j)] = start + (forward[s] if kind == "F" else backward[s])
                cursor[s] += 1
                progressed = True
        assert progressed, "the schedule deadlocked"
    return max(free)


@fuzz(60)
@given(st.integers(2, 4).flatmap(lambda p: st.tuples(
    st.lists(st.integers(1, 9), min_size=p, max_size=p), st.lists(st.integers(1, 9), min_size=p, max_size=p),
    st.integers(p, 8), st.sampled_from(["gpipe", "1f1b"]))))
def test_no_pipeline_run_beats_the_bound(case):
    forward, backward, m, schedule = case
    busy = [m * (f + b) for f, b in zip(forward, backward, strict=True)]
    k, bubble = pipeline_bound(busy, busy, 1 / m)
    assert busy[k] + bubble <= run_pipeline(forward, backward, m, schedule)


def test_equal_stages_meet_the_bound():
    # with equal stages the bound is the schedule's own length: (m + p - 1) microbatch times
    busy = [8 * 3] * 4
    k, bubble = pipeline_bound(busy, busy, 1 / 8)
    assert busy[k] + bubble == run_pipeline([1] * 4, [2] * 4, 8, "1f1b") == run_pipeline([1] * 4, [2] * 4, 8, "gpipe")
