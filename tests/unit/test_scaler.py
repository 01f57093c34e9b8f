"""The fp16 dynamic loss scaler, alone and inside a one-process engine."""

import logging

import pytest
import torch

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.scaler import INITIAL_SCALE, MAX_SKIPS_AT_MIN, LossScaleExhausted, LossScaler

MODEL = ModelConfig(vocab_size=128, n_layers=2, n_heads=4, d_model=32, d_ff=64, max_seq_len=64)
DATA = DataConfig(seq_len=16)


def fp16_engine(**train) -> Engine:
    cfg = TrainConfig(**{"steps": 10, "global_batch": 4, "micro_batch": 2, "lr": 3e-3, "precision": "fp16", **train})
    return Engine(MODEL, DATA, cfg, ParallelConfig(), rank=0, world_size=1)


def test_overflow_halves_and_clean_steps_double():
    scaler = LossScaler(scale=8.0, growth_interval=3)
    scaler.update(True, step=0)
    assert (scaler.scale, scaler.skipped, scaler.clean_steps) == (4.0, 1, 0)
    for step in range(1, 3):
        scaler.update(False, step)
    assert scaler.scale == 4.0 and scaler.clean_steps == 2
    scaler.update(False, 3)
    assert scaler.scale == 8.0 and scaler.clean_steps == 0
    scaler.update(False, 4)
    scaler.update(True, 5)  # an overflow restarts the count towards growth
    assert (scaler.scale, scaler.clean_steps, scaler.skipped) == (4.0, 0, 2)


def test_overflows_that_go_on_at_the_minimum_scale_end_the_skipping():
    scaler = LossScaler(scale=4.0, min_scale=1.0)
    for step in range(3):  # 4 -> 2 -> 1 -> 1: the third is the first at the minimum
        scaler.update(True, step)
    assert scaler.scale == 1.0 and scaler.skipped_at_min == 1
    scaler.update(False, 3)  # a clean step: the run at the minimum starts over
    assert scaler.skipped_at_min == 0
    for step in range(4, 4 + MAX_SKIPS_AT_MIN - 1):
        scaler.update(True, step)
    with pytest.raises(LossScaleExhausted, match=r"fp16 overflow at step 11 with the loss scale at its minimum \(1\), "
                       f"{MAX_SKIPS_AT_MIN} steps in a row.*lower train.lr"):
        scaler.update(True, 4 + MAX_SKIPS_AT_MIN - 1)


def test_unscale_divides_and_finds_non_finite_values():
    scaler = LossScaler(scale=4.0)
    grads = [torch.full((3,), 8.0), torch.tensor([2.0, 4.0])]
    assert scaler.unscale_(grads) is False
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.tensor([0.5, 1.0]))
    assert scaler.unscale_([torch.ones(2), torch.tensor([1.0, float("inf")])]) is True
    assert scaler.unscale_([torch.tensor([float("nan")])]) is True


def test_state_round_trip_and_bad_state():
    scaler = LossScaler(scale=1024.0, growth_interval=5)
    scaler.update(True, 0)
    scaler.update(False, 1)
    other = LossScaler()
    other.load_state(scaler.state())
    assert other.state() == scaler.state() == {"scale": 512.0, "clean_steps": 1, "skipped": 1, "skipped_at_min": 0}
    older = {"scale": 512.0, "clean_steps": 1, "skipped": 1}  # a checkpoint of an older release
    other.skipped_at_min = 5
    other.load_state(older)
    assert other.skipped_at_min == 0
    with pytest.raises(ValueError, match="not a positive number"):
        other.load_state({"scale": float("inf"), "clean_steps": 0, "skipped": 0})
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaler(growth_interval=0)


def test_engine_skips_an_overflowing_step_and_logs_it(caplog):
    engine = fp16_engine()
    first = engine.train_step()
    assert not first.skipped and first.loss_scale == INITIAL_SCALE and first.grad_norm > 0
    engine.scaler.scale = 2.0**60  # far beyond fp16's range: the backward overflows
    before = engine.state_tensors()
    with caplog.at_level(logging.WARNING, logger="trainer.scaler"):
        skipped = engine.train_step()
    assert skipped.skipped and skipped.loss_scale == 2.0**60 and skipped.grad_norm == float("inf")
    assert "fp16 overflow at step 1" in caplog.text and "-> 5.76461e+17" in caplog.text
    after = engine.state_tensors()
    assert all(torch.equal(after[name], value) for name, value in before.items())  # no update at all
    assert engine.next_step == 2 and engine.scaler.scale == 2.0**59
    assert engine.state_meta()["scaler"] == {"scale": 2.0**59, "clean_steps": 0, "skipped": 1, "skipped_at_min": 0}


def test_fp16_scaler_state_survives_save_and_load_bit_exactly():
    engine = fp16_engine()
    engine.train_step()
    engine.scaler.scale = 2.0**40
    assert engine.train_step().skipped  # the scale halves
    tensors, meta = engine.state_tensors(), engine.state_meta()
    fresh = fp16_engine()
    fresh.load_state(tensors, meta)
    assert fresh.scaler.state() == engine.scaler.state()
    assert [fresh.train_step().loss for _ in range(3)] == [engine.train_step().loss for _ in range(3)]
    assert fresh.state_tensors().keys() == engine.state_tensors().keys()
    for name, value in engine.state_tensors().items():
        assert torch.equal(fresh.state_tensors()[name], value), name


def test_bf16_and_fp32_have_no_scaler():
    for precision in ("fp32", "bf16"):
        engine = fp16_engine(precision=precision)
        result = engine.train_step()
        assert engine.scaler is None and result.loss_scale == 1.0 and not result.skipped
        assert engine.state_meta()["scaler"] is None


def test_resuming_across_precisions_says_what_happens_to_the_loss_scale(caplog):
    fp16 = fp16_engine()
    fp16.train_step()
    tensors, meta = fp16.state_tensors(), fp16.state_meta()
    assert meta["precision"] == "fp16"
    bf16 = fp16_engine(precision="bf16")
    with caplog.at_level(logging.WARNING, logger="trainer.engine_state"):
        bf16.load_state(tensors, meta)
    assert "resuming a checkpoint trained in fp16 with train.precision bf16: its fp16 loss scale is dropped" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.engine_state"):
        fp16_engine().load_state(tensors, meta)  # the same precision: nothing to say
        fp16_engine().load_state(tensors, {k: v for k, v in meta.items() if k != "precision"})  # an older release's
    assert "resuming a checkpoint" not in caplog.text
    from trainer.engine_state import _precision_change

    assert _precision_change("bf16", "fp16") == "the loss scale starts at 2^16"
    assert _precision_change("fp32", "bf16").startswith("the forward rounds otherwise")
