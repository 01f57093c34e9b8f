"""HSDP (`parallel.dp_replicate`) without processes: what the spec and the engine refuse, the
cost model's state per rank, the (replica, shard) grid of the checkpoint slices, and elastic
shrinking and growing by whole replicas (the controller with a fake worker group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckpt.storage import Storage
from orchestrator.controller.policies import ScalingPolicy
from orchestrator.spec.job_spec import load_spec, validate_spec
from orchestrator.spec.problems import SpecError
from orchestrator.wire.store import RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec
from tests.unit.test_spec import EXAMPLES
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel import hardware, plan
from trainer.costmodel.layout import Layout, Workload
from trainer.costmodel.memory import ledgers
from trainer.dtensor_slices import geometry, make_grid, scalar_geometry
from trainer.layout_checks import layout_refusals
from trainer.topology import Topology

TINY = ModelConfig(preset="tiny")


def _problems(parallel: dict) -> list:
    data = {"name": "hsdp", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 2, "global_batch": 8}, "parallel": parallel,
            "checkpoint": {"url": "file:///tmp/undying-hsdp-test"}}
    with pytest.raises(SpecError) as caught:
        validate_spec(data)
    return caught.value.problems


def test_the_spec_refuses_replicas_that_do_not_divide_dp_and_hsdp_without_sharding():
    (problem,) = _problems({"dp": 4, "dp_replicate": 3, "zero": 3})
    assert problem.field == "parallel.dp_replicate" and "use one of 1, 2, 4" in problem.message
    for zero in (0, 1):
        (problem,) = _problems({"dp": 4, "dp_replicate": 2, "zero": zero})
        assert problem.field == "parallel.zero" and "set parallel.zero to 2 or 3" in problem.message
    (problem,) = _problems({"dp": 2, "dp_replicate": 2, "zero": 3})
    assert problem.field == "parallel.dp_replicate" and "one rank per replica" in problem.message
    # the planner's layouts are refused by the same function
    assert [r.field for r in layout_refusals(TINY, Layout(dp=4, dp_replicate=2, zero=1))] == ["parallel.zero"]
    assert layout_refusals(TINY, Layout(dp=4, dp_replicate=2, zero=2)) == []


def test_an_elastic_dp_keeps_the_shard_size():
    hsdp = ParallelConfig(dp=8, dp_replicate=4, zero=3)
    assert (hsdp.dp_shard, hsdp.dp_unit) == (2, 2)
    assert (hsdp.with_dp(4).dp, hsdp.with_dp(4).dp_replicate, hsdp.with_dp(4).dp_shard) == (4, 2, 2)
    assert ParallelConfig(dp=4, zero=3).with_dp(3).dp_replicate == 1  # FSDP over all of dp: any dp


def test_state_bytes_per_rank_divide_by_one_replica():
    work = Workload(model=TINY, seq_len=16, global_batch=8)
    hsdp = ledgers(work, Layout(dp=4, dp_replicate=2, zero=3)).state
    assert hsdp == ledgers(work, Layout(dp=2, zero=3)).state
    assert hsdp == pytest.approx(2 * ledgers(work, Layout(dp=4, zero=3)).state, abs=2)
    assert Layout(dp=4, dp_replicate=2, zero=3).label().startswith("dp2x2 ")


def test_the_planner_ranks_hsdp_layouts_and_none_the_engine_refuses():
    spec = SimpleNamespace(model=TINY, data=DataConfig(seq_len=16), train=TrainConfig(steps=1, global_batch=16),
                           parallel=ParallelConfig())
    ranked = [c.layout for c in plan(spec, hardware("h100"), 16).valid]
    hsdp = [layout for layout in ranked if layout.dp_replicate > 1]
    assert hsdp and {layout.zero for layout in hsdp} == {2, 3}
    assert all(layout_refusals(TINY, layout, 16, 16, layout.micro_batch) == [] for layout in hsdp)
    assert all(layout.dp_shard >= 2 for layout in hsdp)


def test_the_grid_splits_dp_into_replica_and_shard():
    topology = Topology(dp=4, tp=2, dp_replicate=2)
    assert [topology.replica_of(topology.coords(rank).dp) for rank in range(8)] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)]
    grid = make_grid(dp_rank=3, dp_size=4, tp_rank=1, tp_size=2, dp_replicate=2)
    assert grid.coords == {"dp_replicate": 1, "dp_shard": 1, "tp": 1}
    # a plain tensor is held by all 8 ranks; this rank is the last of them
    assert (geometry((4,), None, grid).replica, geometry((4,), None, grid).replicas) == (7, 8)
    assert (scalar_geometry(grid).replica, scalar_geometry(grid, ("tp",)).replicas) == (7, 2)
    with pytest.raises(ValueError, match="does not divide"):
        Topology(dp=4, dp_replicate=3)


def _tiny(*overrides: str):
    return load_spec(str(EXAMPLES / "tiny.yaml"), overrides=list(overrides))


def test_the_scaling_policy_counts_whole_replicas():
    spec = _tiny("parallel.dp=6", "parallel.dp_replicate=3", "parallel.zero=2", "train.global_batch=12",
                 "train.micro_batch=1")
    policy = ScalingPolicy.for_spec(spec)
    assert [policy.best_dp(ranks) for ranks in (1, 2, 3, 5, 6, 9)] == [None, 2, 2, 4, 6, 6]
    assert policy.no_dp_because(1) == ("no dp from 1 down to elastic.min_dp=1 works (dp 1: not whole replicas of "
                                       "2 ranks (parallel.dp_replicate))")


def test_a_min_dp_the_batch_cannot_shrink_to_says_which_fields_decide():
    # dp 4 and min_dp 3 with a global batch of 16 in microbatches of 2: dp 3 does not divide it.
    policy = ScalingPolicy.for_spec(_tiny("parallel.dp=4", "elastic.min_dp=3", "train.global_batch=16"))
    assert policy.best_dp(3) is None
    assert policy.no_dp_because(3) == ("no dp from 3 down to elastic.min_dp=3 works (dp 3: dp=3: global_batch 16 "
                                       "not divisible by 3 (train.global_batch))")
    assert policy.no_dp_because(2) == "2 rank(s) hold dp 2, below elastic.min_dp=3"
    refusing = ScalingPolicy(target_dp=4, min_dp=1, refusal=lambda dp: None if dp == 4 else f"no {dp} (parallel.x)")
    assert refusing.best_dp(8) == 4 and refusing.best_dp(3) is None
    assert refusing.no_dp_because(3) == ("no dp from 3 down to elastic.min_dp=1 works (dp 3: no 3 (parallel.x); "
                                         "dp 2: no 2 (parallel.x); dp 1: no 1 (parallel.x))")


def test_a_lost_rank_drops_its_whole_replica_and_the_job_grows_back(tmp_path):
    # dp 4 = 2 replicas x 2 shards: rank 1 (replica 0) dies without a replacement. The job
    # shrinks to replica 1 (old ranks 2 and 3), not to 3 ranks, and grows back to 2 replicas.
    spec = _spec(tmp_path, parallel={"dp": 4, "dp_replicate": 2, "zero": 3})
    rendezvous = RendezvousServer("127.0.0.1")
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={15: 1}, cold_start_works=False)
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    kept: list[list[int]] = []
    real_renumber = workers.renumber
    workers.renumber = lambda keep: (kept.append(list(keep)), real_renumber(keep))
    report = ctl.run()
    assert report.status == "succeeded", report.error
    assert kept == [[2, 3]]
    assert workers.dp_history == [4, 2, 4]
    assert any("shrinking dp 4 -> 2" in line for line in lines)


def test_the_scaling_policy_of_a_spec_skips_a_dp_whose_layout_the_engine_refuses():
    # An interleaved pipeline needs whole rounds of pp microbatches per rank: at dp 5, 10 / 5 = 2 (one
    # round); dp 2 divides the batch (5 microbatches) but not into rounds of 2, so losing one replica
    # of five must shrink to dp 1, not to a dp every rank would refuse.
    spec = validate_spec({"name": "j", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
                          "train": {"steps": 4, "global_batch": 10, "micro_batch": 1},
                          "parallel": {"dp": 5, "pp": 2, "schedule": "interleaved", "virtual_stages": 2},
                          "checkpoint": {"url": "memory://ck"}})
    policy = ScalingPolicy.for_spec(spec)
    assert policy.valid(5) and not policy.valid(2) and policy.valid(1)
    assert policy.best_dp(8) == 1  # four replicas' ranks: dp 4 and 3 do not divide the batch, 2 would not run


@pytest.mark.parametrize(("overrides", "words"), [
    (["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=2", "elastic.min_dp=3"],
     "no dp from 3 down to 3 runs (not whole replicas of 2 ranks (parallel.dp_replicate))"),
    (["parallel.dp=4", "elastic.min_dp=3", "train.global_batch=16", "train.micro_batch=1"],
     "no dp from 3 down to 3 runs (dp=3: global_batch 16 not divisible by 3 (train.global_batch))"),
])
def test_a_min_dp_that_no_smaller_dp_reaches_is_said_before_anything_starts(overrides, words):
    from orchestrator.spec.elastic import shrink_notes

    # Valid (it runs as min_dp = dp would), with a note that says so and how to fix it.
    [note] = shrink_notes(load_spec(str(EXAMPLES / "tiny.yaml"), overrides=overrides))
    assert note.startswith("elastic.min_dp: 3 lets the job shrink below parallel.dp = 4") and words in note
    assert note.endswith("set it to 4 to say so, or to 2, the largest smaller dp that runs")
    for fixed in ("elastic.min_dp=2", "elastic.min_dp=4"):
        assert shrink_notes(load_spec(str(EXAMPLES / "tiny.yaml"), overrides=[*overrides, fixed])) == []
