"""Parameter-server mode, without processes: the shard plan, the clocks and bound, the spec checks."""

from __future__ import annotations

import pytest
import torch

from orchestrator.spec.job_spec import SpecError, validate_spec
from paramserver.clocks import Clocks, UpdateRecord, ahead_limit, format_histogram, staleness_histogram
from paramserver.partition import ParamShape, param_shapes, plan_shards, shard_bytes
from trainer.config import ModelConfig
from trainer.model import meta_model


def _tiny_shapes(**kw) -> list[ParamShape]:
    return param_shapes(meta_model(ModelConfig(preset="tiny", **kw)).named_parameters())


def _coverage(shards) -> dict[str, torch.Tensor]:
    counts = {}
    for shard in shards:
        for piece in shard:
            count = counts.setdefault(piece.name, torch.zeros(piece.global_shape, dtype=torch.int32))
            count[piece.index()] += 1
    return counts


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_every_element_is_owned_exactly_once_and_loads_are_balanced(servers):
    params = _tiny_shapes(tie_embeddings=False)
    shards = plan_shards(params, servers)
    counts = _coverage(shards)
    assert sorted(counts) == sorted("model/" + p.name for p in params)
    assert all(bool((c == 1).all()) for c in counts.values())
    total = sum(p.nbytes for p in params)
    largest_piece = max(piece.nbytes for shard in shards for piece in shard)
    # LPT: no server more than one piece above the mean share.
    assert max(shard_bytes(s) for s in shards) <= total / servers + largest_piece
    assert sum(shard_bytes(s) for s in shards) == total


def test_a_large_tensor_is_cut_into_row_bands_over_servers():
    params = [ParamShape("tok_emb.weight", (1000, 16)), ParamShape("norm.weight", (16,))]
    shards = plan_shards(params, 4)
    bands = [piece for shard in shards for piece in shard if piece.name == "model/tok_emb.weight"]
    assert len(bands) > 4 and all(piece.lengths[1] == 16 for piece in bands)
    assert {k for k, shard in enumerate(shards) if any(p.name == "model/tok_emb.weight" for p in shard)} \
        == {0, 1, 2, 3}
    loads = [shard_bytes(s) for s in shards]
    assert max(loads) - min(loads) <= max(piece.nbytes for piece in bands)


def test_the_plan_is_deterministic_and_a_scalar_is_never_cut():
    params = _tiny_shapes()
    assert plan_shards(params, 3) == plan_shards(list(params), 3)
    shards = plan_shards([ParamShape("scale", ()), ParamShape("gain", (4096,))], 2, max_piece_bytes=64)
    assert [p.lengths for s in shards for p in s if p.name == "model/scale"] == [()]
    assert bool((_coverage(shards)["model/gain"] == 1).all())


def test_bounds_per_consistency():
    assert ahead_limit("bsp", None) == 0
    assert ahead_limit("ssp", 3) == 3
    assert ahead_limit("asp", None) is None


def test_a_pull_waits_for_the_slowest_worker_within_the_bound():
    clocks = Clocks(workers=3)
    assert clocks.may_read(0, 0) and not clocks.may_read(1, 0)
    for w in range(3):
        clocks.tick(w, 0)
    assert clocks.may_read(1, 0)
    clocks.tick(0, 1)
    clocks.tick(0, 2)
    # worker 0 is at step 3, the slowest at 1: 2 ahead.
    assert not clocks.may_read(3, 1) and clocks.may_read(3, 2) and clocks.may_read(3, None)
    with pytest.raises(ValueError, match="expected step 1"):
        clocks.tick(1, 2)


def test_staleness_is_the_version_gap_and_the_histogram_counts_it():
    records = [UpdateRecord(0, 0, 5, pulled_version=9, applied_version=11, slowest_at_pull=4),
               UpdateRecord(0, 1, 4, 9, 9, 4), UpdateRecord(1, 1, 4, 3, 5, 4)]
    assert [r.staleness for r in records] == [2, 0, 2]
    assert [r.ahead for r in records] == [1, 0, 0]
    assert staleness_histogram(records) == {0: 1, 2: 2}
    assert "#" in format_histogram({0: 1, 2: 2}) and format_histogram({}) == "  (no updates)"


def _spec(parallel: dict, train: dict | None = None):
    return dict(name="ps", model={"preset": "tiny"}, data={"seq_len": 16},
                train={"steps": 2, "global_batch": 4, "grad_clip": None, **(train or {})}, parallel=parallel,
                checkpoint={"url": "file:///tmp/undying-test-ps", "every_steps": 1, "async": False})


def _fields(raw) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        validate_spec(raw)
    return {p.field: p.message for p in err.value.problems}


def test_the_spec_refuses_what_ps_mode_cannot_run_naming_each_field():
    problems = _fields(_spec({"dp": 2, "tp": 2, "zero": 1, "mode": "ps", "consistency": "ssp"},
                             {"grad_clip": 1.0, "precision": "bf16"}))
    assert set(problems) == {"parallel.tp", "parallel.zero", "parallel.staleness", "train.grad_clip",
                             "train.precision"}
    assert "set parallel.tp: 1" in problems["parallel.tp"]
    assert _fields(_spec({"dp": 2, "mode": "ps", "staleness": 2})).keys() == {"parallel.staleness"}
    assert _fields(_spec({"dp": 2, "servers": 2})).keys() == {"parallel.servers"}
    assert "servers" in str(_fields(_spec({"dp": 2, "mode": "ps", "servers": 0})))
    slow = {"kind": "slow_rank", "rank": 1, "at_step": 1, "factor": 2.0}
    faulty = dict(_spec({"dp": 2, "mode": "ps"}), chaos={"faults": [slow]})
    assert _fields(faulty).keys() == {"chaos.faults[0].kind"}


def test_a_valid_ps_spec_and_the_collective_default():
    spec = validate_spec(_spec({"dp": 2, "mode": "ps", "servers": 2, "consistency": "ssp",
                                         "staleness": 1}))
    assert (spec.parallel.mode, spec.parallel.servers, spec.parallel.staleness) == ("ps", 2, 1)
    assert validate_spec(_spec({"dp": 2})).parallel.mode == "collective"


def test_undying_run_refuses_a_ps_job_it_cannot_run_before_starting_ray(capsys):
    from orchestrator.cli.main import main

    assert main(["run", "examples/ps.yaml", "--set", "parallel.pp=2", "--set", "train.grad_clip=0.5"]) == 2
    err = capsys.readouterr()
    assert "parallel.pp" in err.out + err.err and "train.grad_clip" in err.out + err.err
    assert main(["run", "examples/ps.yaml", "--timeline", "/tmp/undying-ps-timeline.png"]) == 2
    assert "--timeline" in "".join(capsys.readouterr())
