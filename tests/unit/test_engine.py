"""The engine in one process (world_size=1): stepping, token weighting, state, errors."""

import pytest
import torch
import torch.nn.functional as F

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import FAULT_POINTS, Engine
from trainer.loss import IGNORE_INDEX
from trainer.model import build_model
from trainer.optim import lr_at

MODEL = ModelConfig(preset="tiny")
DATA = DataConfig(seq_len=32)


def make_engine(model=MODEL, data=DATA, parallel=None, fault_hook=None, **train) -> Engine:
    train_cfg = TrainConfig(**{"steps": 20, "global_batch": 8, "micro_batch": 2, "lr": 1e-3, **train})
    return Engine(model, data, train_cfg, parallel or ParallelConfig(), rank=0, world_size=1,
                  fault_hook=fault_hook)


def test_loss_falls_on_synthetic_data():
    engine = make_engine(steps=40, lr=3e-3, warmup_steps=5, global_batch=16, micro_batch=16)
    losses = [engine.train_step().loss for _ in range(40)]
    assert losses[0] == pytest.approx(5.55, abs=0.1)  # ln(256): the initial model is uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_step_result_describes_the_global_batch():
    engine = make_engine(warmup_steps=4)
    result = engine.train_step()
    samples = [engine.data.sample(0, i) for i in range(8)]
    assert result.step == 0 and engine.next_step == 1
    assert result.tokens == sum(len(s) - 1 for s in samples)
    assert result.lr == lr_at(0, engine.train_config)
    assert result.grad_norm > 0
    assert 0 < result.compute_s <= result.step_s
    assert engine.train_step().step == 1


def test_accumulated_gradient_is_the_gradient_of_the_token_mean():
    """Microbatches of different lengths: the gradient must weight every token equally."""
    grads = {}

    def capture(point, step):
        if point == "after_backward":
            grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()})

    engine = make_engine(micro_batch=1, grad_clip=None)
    engine.fault_hook = capture
    engine.train_step()

    model = build_model(MODEL, seed=0)
    batch = engine.data.microbatches(0, 8, 8, 0, 1)[0]
    logits = model(batch.input_ids)
    F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("micro_batch", [1, 4])
def test_microbatch_size_does_not_change_the_step(micro_batch):
    whole, split = make_engine(micro_batch=8), make_engine(micro_batch=micro_batch)
    initial = {n: t.clone() for n, t in whole.state_tensors().items() if n.startswith("model/")}
    for _ in range(3):
        ours, reference = split.train_step(), whole.train_step()
        # fp32: the two splits sum the same terms in another order, a few ulps of a loss near 5.
        assert ours.loss == pytest.approx(reference.loss, rel=1e-6)
        assert ours.grad_norm == pytest.approx(reference.grad_norm, rel=1e-5)  # a scale Adam's update would hide
    # Adam divides each gradient element by its own running RMS, so where a gradient is near 0 the
    # reordering's last-bit difference becomes a visible one (2e-6 of a 3e-3 update, measured on an
    # AVX-512 host): each tensor's update is compared as a whole.
    whole_state, split_state = whole.state_tensors(), split.state_tensors()
    for name, before in initial.items():
        update = whole_state[name] - before
        assert (split_state[name] - before - update).norm() <= 1e-4 * update.norm(), name


def run_and_snapshot(engine: Engine, steps: int, snapshot_at: int):
    losses, snapshot = [], None
    for _ in range(steps):
        if engine.next_step == snapshot_at:
            snapshot = engine.state_tensors(), engine.state_meta()
        losses.append(engine.train_step().loss)
    return losses, snapshot


@pytest.mark.parametrize(
    "options",
    [dict(), dict(precision="bf16"), dict(optimizer="sgd", weight_decay=0.0), dict(warmup_steps=3)],
    ids=["fp32", "bf16", "sgd", "warmup"],
)
@pytest.mark.parametrize("snapshot_at", [0, 3])
def test_resume_is_bit_exact(options, snapshot_at):
    model = ModelConfig(preset="tiny", dropout=0.1)
    straight = make_engine(model=model, **options)
    losses, (tensors, meta) = run_and_snapshot(straight, 6, snapshot_at)
    resumed = make_engine(model=model, **options)
    resumed.load_state(tensors, meta)
    assert resumed.next_step == snapshot_at
    assert [resumed.train_step().loss for _ in range(6 - snapshot_at)] == losses[snapshot_at:]
    final, again = straight.state_tensors(), resumed.state_tensors()
    assert final.keys() == again.keys()
    for name, value in final.items():
        assert torch.equal(again[name], value), name


def test_state_tensors_names_and_copies():
    engine = make_engine()
    assert all(name.startswith("model/") for name in engine.state_tensors())
    engine.train_step()
    state = engine.state_tensors()
    params = [name for name, _ in engine.model.named_parameters()]
    assert set(state) == {f"model/{n}" for n in params} | {
        f"optim/{n}/{field}" for n in params for field in ("exp_avg", "exp_avg_sq", "step")
    }
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in state.values())
    state["model/norm.weight"].fill_(7.0)  # a snapshot, not a view of the live weights
    assert not torch.equal(engine.model.norm.weight.detach(), state["model/norm.weight"])
    meta = engine.state_meta()
    assert meta["next_step"] == 1 and meta["data_seed"] == DATA.seed
    assert meta["layout"]["dp"] == 1


def test_sgd_state_holds_momentum():
    engine = make_engine(optimizer="sgd")
    engine.train_step()
    assert "optim/tok_emb.weight/momentum_buffer" in engine.state_tensors()


def test_load_state_rejects_a_checkpoint_that_does_not_fit():
    engine = make_engine()
    engine.train_step()
    tensors, meta = engine.state_tensors(), engine.state_meta()
    fresh = make_engine()
    with pytest.raises(ValueError, match="data_seed=0 but this run has 1"):
        make_engine(data=DataConfig(seq_len=32, seed=1)).load_state(tensors, meta)
    with pytest.raises(ValueError, match="missing \\['model/norm.weight'\\]"):
        fresh.load_state({k: v for k, v in tensors.items() if k != "model/norm.weight"}, meta)
    with pytest.raises(ValueError, match="unexpected \\['model/extra'\\]"):
        fresh.load_state({**tensors, "model/extra": torch.zeros(1)}, meta)
    with pytest.raises(ValueError, match="has shape \\(3,\\)"):
        fresh.load_state({**tensors, "model/norm.weight": torch.zeros(3)}, meta)
    with pytest.raises(ValueError, match="covers 1 of"):
        fresh.load_state({k: v for k, v in tensors.items()
                          if k.startswith("model/") or k.startswith("optim/norm.weight/")}, meta)
    make_engine(seed=7).load_state(tensors, meta)  # without dropout the seed draws nothing after a restore
    dropout = MODEL.model_copy(update={"dropout": 0.1})
    with pytest.raises(ValueError, match="train_seed=0 but this run has 7"):  # its masks would differ
        make_engine(model=dropout, seed=7).load_state(tensors, meta)


def test_fault_hook_points_in_order():
    calls = []
    engine = make_engine(fault_hook=lambda point, step: calls.append((point, step)))
    engine.train_step()
    engine.train_step()
    # One process has no gradient all-reduce: in_allreduce is a DDP point (tests/dist covers it).
    points = [p for p in FAULT_POINTS if p != "in_allreduce"]
    assert calls == [(point, step) for step in (0, 1) for point in points]
    engine.fault_hook = None  # the rank loop re-arms or disarms the hook between steps
    engine.train_step()
    assert len(calls) == 2 * len(points)


def test_a_raising_fault_hook_stops_the_step_before_the_update():
    engine = make_engine()
    before = engine.state_tensors()

    def explode(point, step):
        if point == "after_backward":
            raise RuntimeError("injected")

    engine.fault_hook = explode
    with pytest.raises(RuntimeError, match="injected"):
        engine.train_step()
    assert engine.next_step == 0
    assert all(torch.equal(before[k], v) for k, v in engine.state_tensors().items())


def test_configuration_errors_name_the_field():
    with pytest.raises(ValueError, match="world_size=1 but parallel.dp\\*tp\\*pp = 1\\*2\\*1 = 2"):
        make_engine(parallel=ParallelConfig(tp=2))
    with pytest.raises(ValueError, match="world_size=1 but parallel.dp\\*tp\\*pp = 1\\*1\\*2 = 2"):
        make_engine(parallel=ParallelConfig(pp=2))
    with pytest.raises(ValueError, match="world_size=1 but parallel.dp=2"):
        make_engine(parallel=ParallelConfig(dp=2))
    with pytest.raises(ValueError, match="train.global_batch: 8 is not divisible"):
        make_engine(micro_batch=3)
    with pytest.raises(ValueError, match="data.seq_len: 300 exceeds model.max_seq_len = 256"):
        make_engine(data=DataConfig(seq_len=300))
    cfgs = MODEL, DATA, TrainConfig(steps=1, global_batch=8), ParallelConfig(dp=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Engine(*cfgs, rank=0, world_size=2)


@pytest.mark.parametrize(("model", "parallel", "message"), [
    (MODEL, ParallelConfig(tp=3), "model.n_heads = 4 is not divisible by tp = 3"),
    (ModelConfig(preset="tiny", d_ff=255), ParallelConfig(tp=2), "model.d_ff = 255 is not divisible by tp = 2"),
    (ModelConfig(preset="tiny", vocab_size=255), ParallelConfig(tp=2), "model.vocab_size = 255 is not divisible"),
    (ModelConfig(preset="tiny", max_seq_len=33), ParallelConfig(tp=2), "pads data.seq_len = 33 to 34"),
])
def test_tensor_parallel_errors_name_the_field_and_the_fix(model, parallel, message):
    # Checked before any collective, so one process sees the error every rank would.
    data = DataConfig(seq_len=33) if model.max_seq_len == 33 else DATA
    train = TrainConfig(steps=1, global_batch=8)
    with pytest.raises(ValueError, match=message):
        Engine(model, data, train, parallel, rank=0, world_size=parallel.world_size)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_state_slices_round_trip_and_wanted_geometry(optimizer):
    engine = make_engine(optimizer=optimizer)
    before_first_step = {piece.key for piece in engine.wanted_slices()}
    engine.train_step()
    saved = engine.state_slices()
    assert {piece.key for piece in saved} == before_first_step
    assert all(piece.replicas == 1 and piece.tensor is not None for piece in saved)
    by_name = {piece.name: piece for piece in saved}
    fresh = make_engine(optimizer=optimizer)
    fresh.load_slices([w.with_tensor(by_name[w.name].tensor) for w in fresh.wanted_slices()],
                      engine.state_meta())
    assert fresh.train_step().loss == engine.train_step().loss


@pytest.mark.parametrize(("parallel", "global_batch", "message"), [
    (ParallelConfig(pp=2, schedule="pipedream"), 8, "trainer.pipedream.PipeDream2BW"),
    (ParallelConfig(pp=2, dp=2, zero=3, schedule="zero-bubble"), 8, "wrong gradients with ZeRO-3"),
    (ParallelConfig(pp=2, dp=2, zero=1, schedule="zero-bubble"), 8, "use parallel.zero=2"),
    (ParallelConfig(pp=2, dp=2, zero=0, schedule="zero-bubble"), 8, "DDP"),
    (ParallelConfig(pp=2, schedule="zero-bubble", virtual_stages=3), 8, "exactly 2 chunks per rank"),
    (ParallelConfig(pp=2, schedule="interleaved", virtual_stages=1), 8, "virtual_stages >= 2"),
    (ParallelConfig(pp=2, schedule="1f1b", virtual_stages=2), 8, "one chunk per rank"),
    (ParallelConfig(pp=2, schedule="1f1b"), 1, "at least pp=2 microbatches"),
    (ParallelConfig(pp=2, schedule="interleaved"), 5, "rounds of pp=2"),
    (ParallelConfig(pp=4, schedule="interleaved"), 8, "cannot cut 4 layers into 8 pipeline chunks"),
])
def test_pipeline_layouts_the_engine_cannot_run_are_refused(parallel, global_batch, message):
    # Checked before any collective, so one process sees the error every rank would.
    train = TrainConfig(steps=1, global_batch=global_batch)
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, DATA, train, parallel, rank=0, world_size=parallel.world_size)


def test_without_a_pipeline_the_bubble_is_zero_and_compute_is_timed():
    result = make_engine().train_step()
    assert result.bubble == 0.0
    assert 0.0 < result.compute_s <= result.step_s
