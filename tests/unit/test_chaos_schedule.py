"""Fault schedules: explicit faults and seeded Poisson failures, expanded into events."""

from __future__ import annotations

import statistics
import time

import pytest

from chaos.config import ChaosConfig, FaultSpec
from chaos.schedule import due_by_time, expand, poisson_times, random_faults

NODES = ["n0", "n1", "n2", "n3"]


def test_same_seed_same_times_and_targets():
    chaos = ChaosConfig(mtbf_s="10m", seed=7)
    first = expand(chaos, horizon_s=6 * 3600, nodes=NODES)
    # Another cluster: other node ids (Ray draws them), the same places (by lowest rank hosted).
    again = expand(chaos, horizon_s=6 * 3600, nodes=[f"other-{n}" for n in NODES])
    other = expand(chaos.model_copy(update={"seed": 8}), horizon_s=6 * 3600, nodes=NODES)
    key = [(e.at_seconds, NODES.index(e.node), e.kind) for e in first]
    assert key == [(e.at_seconds, NODES.index(e.node.removeprefix("other-")), e.kind) for e in again]
    assert [(e.at_seconds, e.node) for e in first] != [(e.at_seconds, e.node) for e in other]
    assert len({e.node for e in first}) == len(NODES)


def test_targets_fail_independently_of_each_other():
    # Adding a node leaves the failures of the others where they were.
    chaos = ChaosConfig(mtbf_s="10m", seed=1)
    three = {(e.at_seconds, e.node) for e in expand(chaos, horizon_s=7200, nodes=NODES[:3])}
    four = {(e.at_seconds, e.node) for e in expand(chaos, horizon_s=7200, nodes=NODES)}
    assert three < four and {node for _, node in four - three} == {"n3"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_interarrival_is_mtbf_over_targets(seed):
    mtbf, horizon = 100.0, 100_000.0
    times = [f.at_seconds for f in random_faults(ChaosConfig(mtbf_s=mtbf, seed=seed), horizon_s=horizon, nodes=NODES)]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert len(times) > 3000
    assert statistics.fmean(gaps) == pytest.approx(mtbf / len(NODES), rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(mtbf / len(NODES), rel=0.1)


def test_one_target_rate_and_window():
    times = poisson_times(50.0, 200_050.0, seed=3, target="rank0", start_s=50.0)
    assert times[0] > 50.0 and times[-1] < 200_050.0
    assert len(times) / 200_000.0 == pytest.approx(1 / 50.0, rel=0.05)
    with pytest.raises(ValueError, match="positive"):
        poisson_times(0.0, 10.0, seed=0, target="x")


def test_rank_kinds_cap_and_start():
    chaos = ChaosConfig(mtbf_s="1m", mtbf_kind="kill_rank", mtbf_start_s="5m", mtbf_max_faults=4, seed=2)
    faults = random_faults(chaos, horizon_s=3600, ranks=8)
    assert len(faults) == 4 and all(f.kind == "kill_rank" and 0 <= f.rank < 8 and f.node is None for f in faults)
    assert all(f.at_seconds > 300 for f in faults)
    assert [f.at_seconds for f in faults] == sorted(f.at_seconds for f in faults)
    with pytest.raises(ValueError, match="ranks=<world size>"):
        random_faults(chaos, horizon_s=3600)
    with pytest.raises(ValueError, match="nodes="):
        random_faults(ChaosConfig(mtbf_s=60), horizon_s=3600)
    assert random_faults(ChaosConfig(), horizon_s=3600) == []


def test_a_cap_stops_the_draws_and_keeps_the_same_first_failures():
    # With a cap, no target is drawn past it: a day of a frequent failure is not drawn to keep three.
    capped = ChaosConfig(mtbf_s="1s", mtbf_kind="kill_rank", mtbf_max_faults=3, seed=4)
    started = time.perf_counter()
    first = random_faults(capped, horizon_s=86400, ranks=8)
    assert time.perf_counter() - started < 1.0  # uncapped, about 690,000 draws: 24 s on this machine
    uncapped = random_faults(capped.model_copy(update={"mtbf_max_faults": None}), horizon_s=60, ranks=8)
    assert first == uncapped[:3]


def test_explicit_and_random_events_with_ids_and_order():
    chaos = ChaosConfig(
        faults=[FaultSpec(kind="kill_rank", rank=1, at_step=25), FaultSpec(kind="kill_node", node="n2", at_seconds=30),
                FaultSpec(kind="torn_write", at_point="during_shard_write", path="*/shard-*"),
                FaultSpec(kind="hang_rank", rank=0, at_seconds=10)],
        mtbf_s="20s", mtbf_max_faults=2, seed=4,
    )
    events = expand(chaos, horizon_s=600, nodes=NODES)
    assert sorted(e.id for e in events) == list(range(6))
    explicit = {e.id: e for e in events if e.source == "explicit"}
    assert (explicit[0].at_step, explicit[0].rank) == (25, 1) and explicit[1].node == "n2"
    assert explicit[2].fault.path == "*/shard-*" and explicit[2].fault.id == 2
    randoms = [e for e in events if e.source == "random"]
    assert [e.id for e in randoms] == [4, 5] and all(e.kind == "kill_node" for e in randoms)
    timed = [e.at_seconds for e in events if e.at_seconds is not None]
    assert timed == sorted(timed) and events[-1].id == 2  # point-only last, after the step event
    assert events[-2].id == 0
    assert FaultSpec.model_validate(randoms[0].fault.model_dump(exclude={"id"})).kind == "kill_node"
    due = due_by_time(events, now_s=30.0, fired=[3])
    assert all(e.at_seconds <= 30.0 and e.id != 3 for e in due) and 1 in [e.id for e in due]
