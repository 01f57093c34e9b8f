"""`train.compile` without compiling: where the blocks are compiled, and which layouts are refused.

The parity of compiled training with the eager reference is tests/dist/test_compile.py (heavy:
inductor takes tens of seconds per layout on a 2-core host). Nothing here runs a forward, so
nothing is compiled.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from orchestrator.spec.job_spec import engine_support_problems
from trainer.compile import apply_recompute_and_compile
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel.hardware import hardware
from trainer.costmodel.planner import plan
from trainer.engine import Engine
from trainer.layout_checks import layout_refusals
from trainer.model import meta_model

MODEL = ModelConfig(vocab_size=64, n_layers=2, n_heads=2, d_model=16, d_ff=32, max_seq_len=32)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=1, global_batch=4, compile=True)


def test_each_block_is_compiled_in_place_and_names_do_not_change():
    eager, compiled = meta_model(MODEL), meta_model(MODEL)
    apply_recompute_and_compile(compiled, "none", True)
    assert [name for name, _ in compiled.named_parameters()] == [name for name, _ in eager.named_parameters()]
    assert all(block._compiled_call_impl is not None for block in compiled.blocks)
    assert compiled._compiled_call_impl is None  # the embedding, the head and the loss stay eager


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_compiled_blocks_recompute_inside_their_compiled_forward(mode):
    model = apply_recompute_and_compile(meta_model(MODEL), mode, True)
    for block in model.blocks:
        assert isinstance(block.forward, partial) and block.forward.args[1] == mode
        assert not block._forward_pre_hooks  # no composable checkpoint hook (dynamo cannot trace it)
        assert block._compiled_call_impl is not None


def test_without_compile_it_is_recomputation_alone():
    model = apply_recompute_and_compile(meta_model(MODEL), "block", False)
    assert all(block._compiled_call_impl is None and block._forward_pre_hooks for block in model.blocks)
    with pytest.raises(ValueError, match="parallel.recompute='some'"):
        apply_recompute_and_compile(meta_model(MODEL), "some", True)


def test_compile_with_tensor_parallelism_is_refused_with_the_reason():
    (refusal,) = layout_refusals(MODEL, ParallelConfig(tp=2, pp=2), compile=True)
    assert refusal.field == "train.compile" and refusal.key == "tp=2 with train.compile"
    assert str(refusal) == ("train.compile: true with parallel.tp = 2: torch 2.13 fails in the backward of a "
                            "compiled tensor-parallel block (a DTensor redistribution receives a plain gradient); "
                            "set train.compile: false, or parallel.tp: 1")
    assert layout_refusals(MODEL, ParallelConfig(tp=2)) == []
    for offered in (ParallelConfig(dp=2, zero=3, recompute="selective"), ParallelConfig(pp=2, schedule="gpipe"),
                    ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2)):
        assert layout_refusals(MODEL.model_copy(update={"n_layers": 4}), offered, compile=True) == []


def test_compile_with_the_zero_bubble_schedule_is_refused_with_the_reason():
    zero_bubble = ParallelConfig(pp=2, schedule="zero-bubble")
    (refusal,) = layout_refusals(MODEL.model_copy(update={"n_layers": 4}), zero_bubble, compile=True)
    assert (refusal.field, refusal.key) == ("train.compile", "zero-bubble with train.compile")
    assert "cannot split a compiled block's backward into its input and weight halves" in refusal.message
    assert "schedule '1f1b', 'gpipe' or 'interleaved'" in refusal.message


def test_the_engine_the_spec_and_the_planner_refuse_it_alike():
    with pytest.raises(ValueError, match=r"^train\.compile: true with parallel\.tp = 2"):
        Engine(MODEL, DATA, TRAIN, ParallelConfig(tp=2), rank=0, world_size=2)
    spec = SimpleNamespace(model=MODEL, data=DATA, train=TRAIN, parallel=ParallelConfig(dp=2, tp=2))
    assert [p.field for p in engine_support_problems(spec)] == ["train.compile"]
    result = plan(spec, hardware("h200"), 4)
    assert result.valid and all(c.layout.tp == 1 for c in result.valid)
    assert "tp=2 with train.compile" in {r.key for r in result.rejected}
