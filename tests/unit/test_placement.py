"""The placement plan: one bundle per TP group, seats per rank, spares after (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cluster.capacity import node_problems
from orchestrator.cluster.placement import plan_placement, tp_groups_that_fit
from orchestrator.spec.job_spec import ResourcesConfig, load_spec

ROOT = Path(__file__).resolve().parents[2]


def _load(overrides: list[str]):
    return load_spec(str(ROOT / "examples/demo.yaml"), ["checkpoint.url=memory://placement", *overrides])


def test_each_tp_group_is_one_bundle_and_every_rank_a_seat_of_it():
    res = ResourcesConfig(cpus_per_rank=0.5, gpus_per_rank=1, custom={"slot": 1})
    plan = plan_placement(8, 2, 0, res, "pack")
    assert plan.strategy == "PACK" and plan.n_seats == 8
    assert plan.seat_bundle == [0, 0, 1, 1, 2, 2, 3, 3]  # ranks 2k, 2k+1: one TP group, one node
    assert plan.bundles == [{"CPU": 1.0, "slot": 2, "GPU": 2}] * 4


def test_spares_come_as_whole_tp_groups_when_they_can():
    res = ResourcesConfig()
    assert plan_placement(4, 2, 2, res, "spread").seat_bundle == [0, 0, 1, 1, 2, 2]
    assert plan_placement(4, 2, 2, res, "spread").strategy == "SPREAD"
    assert plan_placement(4, 2, 1, res, "pack").seat_bundle == [0, 0, 1, 1, 2]
    assert plan_placement(4, 1, 2, res, "pack").seat_bundle == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of tp"):
        plan_placement(6, 4, 0, res, "pack")


def test_a_node_holds_whole_groups_only():
    group = {"CPU": 2.0, "slot": 2.0}
    assert tp_groups_that_fit({"CPU": 2.0, "slot": 3.0}, group) == 1
    assert tp_groups_that_fit({"CPU": 8.0, "slot": 4.0}, group) == 2
    assert tp_groups_that_fit({"CPU": 8.0}, group) == 0  # no slot resource at all
    assert tp_groups_that_fit({"CPU": 0.30000000000000004}, {"CPU": 0.1}) == 3


def test_a_tp_group_larger_than_any_node_is_refused_naming_tp():
    spec = _load(["parallel.dp=1", "parallel.tp=4", "model.n_heads=4"])
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}]  # 6 CPUs in total: enough, but not on one node
    [problem] = node_problems(spec, nodes)
    assert problem.field == "parallel.tp"
    assert "a TP group of 4 ranks must sit on one node" in problem.message
    assert "largest node offers 2 CPU" in problem.message and "lower tp" in problem.message
    assert node_problems(spec, [{"CPU": 4.0}]) == []


def test_pure_dp_counts_ranks_per_node():
    spec = _load(["parallel.dp=4", "resources.cpus_per_rank=2"])
    [problem] = node_problems(spec, [{"CPU": 3.0}] * 3)  # 9 CPUs, but each node holds one rank
    assert problem.field == "resources.cpus_per_rank" and "a rank must sit on one node" in problem.message
    assert "3 such group(s) of the 4 needed" in problem.message
