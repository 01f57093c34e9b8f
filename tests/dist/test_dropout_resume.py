"""With dropout on, a run resumed from a checkpoint takes the very steps of the run that never
stopped, in every layout that splits dropout's work across ranks: tensor parallelism with and
without sequence parallelism (shared or own masks), pipeline stages (masks per stage), and
ZeRO-3 sharding. The engine reseeds dropout per step from (seed, step, rank coordinates)
(trainer.engine), so a checkpoint needs no generator state; this checks that nothing else draws
from the generator in a way a resume would not repeat."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.state_slices import assemble

pytestmark = pytest.mark.dist

MODEL = ModelConfig(vocab_size=128, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64, max_seq_len=32,
                    dropout=0.2)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=4, global_batch=8, micro_batch=2, lr=3e-3)
SNAPSHOT_AT = 2
LAYOUTS = {
    "tp2 sequence-parallel": ParallelConfig(tp=2),
    "tp2 replicated activations": ParallelConfig(tp=2, sequence_parallel=False),
    "pp2 1f1b": ParallelConfig(pp=2, schedule="1f1b"),
    "dp2 zero-3": ParallelConfig(dp=2, zero=3),
}


def straight_runs(rank, world_size, model):
    """Per layout: the losses of TRAIN.steps steps, this rank's state slices and meta before
    SNAPSHOT_AT, and its state at the end."""
    out = {}
    for name, parallel in LAYOUTS.items():
        engine = Engine(model, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
        losses, snapshot = [], None
        for _ in range(TRAIN.steps):
            if engine.next_step == SNAPSHOT_AT:
                snapshot = engine.state_slices(), engine.state_meta()
            losses.append(engine.train_step().loss)
        out[name] = losses, snapshot, engine.state_slices()
        del engine
        gc.collect()
    return out


def resumed_runs(rank, world_size, saved):
    """Per layout: a fresh engine loaded from every rank's snapshot, trained to TRAIN.steps; its
    losses and its state at the end."""
    out = {}
    for name, parallel in LAYOUTS.items():
        slices, meta = saved[name]
        engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
        logical = assemble(slices)
        engine.load_slices([w.with_tensor(logical[w.name][w.index()].clone()) for w in engine.wanted_slices()], meta)
        out[name] = [engine.train_step().loss for _ in range(TRAIN.steps - SNAPSHOT_AT)], engine.state_slices()
        del engine
        gc.collect()
    return out


def test_a_resumed_run_with_dropout_takes_the_uninterrupted_runs_steps_in_every_split_layout():
    straight = run_ranks(straight_runs, 2, (MODEL,), timeout_s=600)
    saved = {name: ([piece for ranks in straight for piece in ranks[name][1][0]], straight[0][name][1][1])
             for name in LAYOUTS}
    resumed = run_ranks(resumed_runs, 2, (saved,), timeout_s=600)
    for name in LAYOUTS:
        for rank in range(2):
            assert resumed[rank][name][0] == straight[rank][name][0][SNAPSHOT_AT:], (name, rank)
        final = assemble([piece for ranks in straight for piece in ranks[name][2]])
        again = assemble([piece for ranks in resumed for piece in ranks[name][1]])
        assert again.keys() == final.keys(), name
        for tensor, value in final.items():
            assert torch.equal(again[tensor], value), (name, tensor)
    # Dropout is on in every layout: the same steps without it train otherwise.
    plain = run_ranks(straight_runs, 2, (MODEL.model_copy(update={"dropout": 0.0}),), timeout_s=600)
    for name in LAYOUTS:
        assert plain[0][name][0] != straight[0][name][0], name
