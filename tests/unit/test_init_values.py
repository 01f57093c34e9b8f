"""Initial values independent of the layout (trainer/init_values.py), in one process.

Any slice of a parameter, computed alone, equals that slice of the whole parameter, bit for
bit; and the engine's own construction for sharded layouts (FSDP2 shards, uneven ones
included, tensor-parallel splits, FSDP over TP, pipeline chunks), run rank by rank inside a
fake process group (torch's `fake` backend: collectives return at once), each rank in a thread
of its own (DeviceMesh equality ignores the rank but not the thread, and DTensor's dispatch
caches output specs by mesh equality: two ranks' meshes in one thread would share
coordinates), allocates only each
rank's shards and fills them so that together they are exactly `build_model`'s weights.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import trainer.init_values as init_values
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.dtensor_slices import local
from trainer.engine import Engine
from trainer.init_values import BLOCK, fill_slice, materialize, standard_normal_slice
from trainer.model import build_model, meta_model

SHAPE = (300, 700)  # 210,000 elements: four blocks, the last one partial
SLICES = [((0, 0), SHAPE), ((5, 0), (100, 700)), ((0, 350), (300, 350)), ((17, 123), (201, 401)),
          ((299, 699), (1, 1)), ((93, 0), (1, 700)), ((0, 0), (0, 700))]


def test_a_slice_alone_equals_that_slice_of_the_whole():
    whole = standard_normal_slice(7, "blocks.0.mlp.up_proj.weight", SHAPE, (0, 0), SHAPE)
    assert whole.numel() > 3 * BLOCK
    for offsets, lengths in SLICES:
        part = standard_normal_slice(7, "blocks.0.mlp.up_proj.weight", SHAPE, offsets, lengths)
        rows, cols = (slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))
        assert torch.equal(part, whole[rows, cols]), (offsets, lengths)
    assert whole.std().item() == pytest.approx(1.0, rel=0.02) and abs(whole.mean().item()) < 0.01
    other_name = standard_normal_slice(7, "blocks.1.mlp.up_proj.weight", SHAPE, (0, 0), SHAPE)
    other_seed = standard_normal_slice(8, "blocks.0.mlp.up_proj.weight", SHAPE, (0, 0), SHAPE)
    assert not torch.equal(whole, other_name) and not torch.equal(whole, other_seed)


def test_banded_fill_equals_one_draw(monkeypatch):
    whole = standard_normal_slice(1, "w", SHAPE, (0, 0), SHAPE) * 0.5
    monkeypatch.setattr(init_values, "SPAN", 3 * 700 + 5)  # bands of three rows
    out = torch.full((120, 333), float("nan"))
    fill_slice(out, 1, "w", 0.5, SHAPE, (40, 300))
    assert torch.equal(out, whole[40:160, 300:633])


def test_meta_stays_meta_and_build_model_is_materialize():
    cfg = ModelConfig(preset="tiny")
    on_meta = build_model(cfg, seed=0, device="meta")
    assert all(p.is_meta for p in on_meta.parameters())
    built = dict(build_model(cfg, seed=3).named_parameters())
    for name, param in materialize(meta_model(cfg), 3, "cpu").named_parameters():
        assert torch.equal(param, built[name]), name
    assert torch.equal(built["norm.weight"], torch.ones(cfg.d_model))


LAYOUTS = {
    "zero3_dp3_uneven": dict(dp=3, zero=3),
    "zero3_dp2_tp2": dict(dp=2, tp=2, zero=3),
    "tp4": dict(tp=4),
    "pp2_tp2_zero3_dp2": dict(pp=2, tp=2, dp=2, zero=3),
}


@pytest.fixture
def rank_threads():
    """`run(fn)` calls fn in a new thread and waits for it; the threads stay alive until the test
    ends, so no later rank's thread reuses an earlier one's id (see the module docstring)."""
    release, threads = threading.Event(), []

    def run(fn):
        done, failure = threading.Event(), []

        def body():
            try:
                fn()
            except BaseException as err:  # re-raised in the test's thread
                failure.append(err)
            done.set()
            release.wait()

        threads.append(threading.Thread(target=body, daemon=True))
        threads[-1].start()
        done.wait()
        if failure:
            raise failure[0]

    yield run
    release.set()
    for thread in threads:
        thread.join()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_shards_together_are_the_single_process_weights(layout, rank_threads):
    model = ModelConfig(preset="tiny-llama", n_kv_heads=4)
    parallel = ParallelConfig(**LAYOUTS[layout])
    world = parallel.dp * parallel.tp * parallel.pp
    train = TrainConfig(steps=1, global_batch=world * 2, micro_batch=1, seed=5)
    reference = {f"model/{n}": p.detach() for n, p in build_model(model, seed=train.seed).named_parameters()}
    covered = {name: torch.zeros(tensor.shape, dtype=torch.int64) for name, tensor in reference.items()}

    def build_rank(rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            engine = Engine(model, DataConfig(seq_len=16), train, parallel, rank=rank, world_size=world)
            held = sum(local(p).numel() for p in engine.model.parameters())
            for piece in engine.state_slices():
                box = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths, strict=True))
                assert torch.equal(piece.tensor, reference[piece.name][box]), (rank, piece.name)
                covered[piece.name][box] += 1
        finally:
            dist.destroy_process_group()
        assert held < sum(t.numel() for t in reference.values()), "a sharded rank holds the whole model"

    for rank in range(world):
        rank_threads(lambda rank=rank: build_rank(rank))
    for name, count in covered.items():
        assert bool((count >= 1).all()), f"{name}: some elements on no rank"
