"""HSDP (parallel.dp_replicate) on 4 gloo ranks: 2 replicas x 2 shards, against one process.

Parity: ZeRO 2 and 3 over a 2 x 2 mesh train the reference's losses (1e-5) and parameters
(1e-4), and every slice of the state is reported by both replicas, numbered 0 and 1, so a
checkpoint writes it once. Resharding: a state saved mid-run from HSDP 2x2 loads bit-exact
into FSDP dp4 ZeRO-3, dp2 and one process, which continue the reference's losses; and a
one-process state loads into HSDP 2x2, which continues them too. Heavy: the same with tensor
parallelism and with a pipeline on 8 ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tests.dist import test_engine_3d as three_d
from tests.dist._launch import run_ranks
from tests.dist.test_engine_3d import check_restored, read_back
from tests.dist.test_engine_parallel import DATA, MODEL, STEPS, TRAIN, par, run_parity
from trainer.engine import Engine
from trainer.state_slices import assemble

pytestmark = pytest.mark.dist

SNAPSHOT_AT = 5


def test_hsdp_2x2_zero2_and_zero3_match_one_process():
    ranks = run_parity(4, [par(dp=4, dp_replicate=2, zero=2), par(dp=4, dp_replicate=2, zero=3)])
    for rank_out in ranks:
        for _, slices, _ in rank_out:
            assert {piece.replicas for piece in slices if piece.name == "model/norm.weight"} == {2}


@pytest.mark.heavy  # 8 ranks on two cores
def test_hsdp_with_tensor_parallel_and_with_a_pipeline_matches_one_process():
    # 2 replicas x 2 shards x tp 2: FSDP2 shards the TP shards over the 3-D (replicate, shard, tp) mesh
    run_parity(8, [par(dp=4, dp_replicate=2, tp=2, zero=3)])
    # 2 replicas x 2 shards x pp 2, GPipe (one microbatch per replica) and ZeRO 2 (each stage an FSDP2 root)
    three_d.run_parity(8, [three_d.par(dp=4, dp_replicate=2, pp=2, zero=2, schedule="gpipe")])


def placements_and_state(rank, world_size, parallel, steps):
    """`steps` steps; the placements of one block weight, this rank's slices + meta before step
    SNAPSHOT_AT, and its losses."""
    engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
    weight = engine.model.blocks[0].attn.q_proj.weight
    where = (weight.device_mesh.mesh_dim_names, tuple(weight.placements)) if world_size > 1 else None
    losses, snapshot = [], None
    for _ in range(steps):
        if engine.next_step == SNAPSHOT_AT:
            snapshot = engine.state_slices(), engine.state_meta()
        losses.append(engine.train_step().loss)
    return where, snapshot, losses


def resume(rank, world_size, parallel, saved, meta, steps):
    engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
    engine.load_slices(read_back(saved, engine.wanted_slices()), meta)
    loaded = engine.state_slices(), []
    return loaded, [engine.train_step().loss for _ in range(steps)]


@pytest.mark.heavy  # 45 s on two cores: four launches of ranks
def test_hsdp_checkpoint_reshards_into_fsdp_dp2_one_process_and_back():
    hsdp = par(dp=4, dp_replicate=2, zero=3)
    straight = run_ranks(placements_and_state, 4, (hsdp, STEPS), timeout_s=600)
    where = straight[0][0]
    assert where == (("dp_replicate", "dp_shard"), (Replicate(), Shard(0)))
    saved = [piece for _, (slices, _), _ in straight for piece in slices]
    meta = straight[0][1][1]
    assert meta["layout"]["dp_replicate"] == 2
    snapshot, rest = assemble(saved), straight[0][2][SNAPSHOT_AT:]

    for world, parallel in ((4, par(dp=4, zero=3)), (2, par(dp=2, zero=2))):
        out = run_ranks(resume, world, (parallel, saved, meta, 2), timeout_s=600)
        check_restored([loaded for loaded, _ in out], snapshot, repr(parallel))
        assert out[0][1] == pytest.approx(rest[:2], rel=1e-5)
    single = resume(0, 1, par(), saved, meta, STEPS - SNAPSHOT_AT)
    check_restored([single[0]], snapshot, "one process")
    assert single[1] == pytest.approx(rest, rel=1e-5)

    # ... and a one-process state into HSDP 2x2
    solo = placements_and_state(0, 1, par(), STEPS)
    solo_saved, solo_meta = solo[1]
    back = run_ranks(resume, 4, (hsdp, solo_saved, solo_meta, STEPS - SNAPSHOT_AT), timeout_s=600)
    check_restored([loaded for loaded, _ in back], assemble(solo_saved), "one process -> HSDP 2x2")
    assert back[0][1] == pytest.approx(solo[2][SNAPSHOT_AT:], rel=1e-5)
    assert all(torch.isfinite(torch.tensor(losses)).all() for _, losses in back)
