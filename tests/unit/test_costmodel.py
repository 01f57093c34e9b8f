"""The cost model against docs/design.md's formulas (as oracles) and against what torch really holds.

Oracles are written out here independently of trainer/costmodel: the ZeRO state formulas,
the GPipe bubble, the ring all-reduce. Measured checks build the real model or Engine on
CPU and count bytes: the state ledger against the engine's tensors and gradients, the
activation ledger against the tensors autograd saves for backward.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orchestrator.cli.plan_cmd import plan_main
from orchestrator.spec.job_spec import load_spec
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel import (
    Layout,
    Workload,
    bubble_fraction,
    cpu_hardware,
    hardware,
    ledgers,
    measure_cpu_matmul_flops,
    plan,
    predict,
    predict_step,
    predicted_bubble_ratio,
    predicted_ledgers,
    ring_allreduce_seconds,
    stage_params,
)
from trainer.costmodel.memory import in_flight_microbatches, layer_activation_bytes, m_activation
from trainer.costmodel.planner import capacity_bytes
from trainer.costmodel.time import group_link, rank_flops_per_token
from trainer.engine import Engine
from trainer.loss import token_loss_sum
from trainer.model import build_model, count_params, flops_per_token
from trainer.recompute import apply_recompute

DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")
TINY, SMALL, EIGHT_B = ModelConfig(preset="tiny"), ModelConfig(preset="small"), ModelConfig(preset="llama3.1-8b")
H100, H200 = hardware("h100"), hardware("h200")


def job(model=TINY, seq_len=64, global_batch=16, micro_batch=2, precision="fp32", parallel=None, gpus=0.0):
    """A spec-like view: the sections the cost model reads, without JobSpec's engine limits."""
    return SimpleNamespace(
        model=model, data=DataConfig(seq_len=seq_len),
        train=TrainConfig(steps=10, global_batch=global_batch, micro_batch=micro_batch, precision=precision),
        parallel=parallel or ParallelConfig(), resources=SimpleNamespace(gpus_per_rank=gpus))


# --- docs/design.md formulas as oracles --------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_state_ledger_is_the_zero_formula(zero, dp):
    n = count_params(SMALL)
    w, g, o = 4 * n, 4 * n, 8 * n  # fp32 weights, fp32 gradients, AdamW moments
    # Stage 2 is FSDP2 without resharding after forward: sharded at rest like stage 3 (the
    # gathered weights it keeps from forward to backward are collective memory).
    oracle = {0: w + g + o, 1: w + g + o / dp, 2: (w + g + o) / dp, 3: (w + g + o) / dp}[zero]
    state = ledgers(Workload(SMALL, 1024, 64), Layout(dp=dp, zero=zero)).state
    assert state == pytest.approx(oracle, rel=1e-12)


def test_small_fp32_adamw_state_is_16_bytes_per_parameter():
    assert count_params(SMALL) == pytest.approx(124e6, rel=0.03)  # GPT-2 small
    assert ledgers(Workload(SMALL, 1024, 8), Layout()).state == 16 * count_params(SMALL)
    sgd = Workload(SMALL, 1024, 8, optimizer="sgd")
    assert ledgers(sgd, Layout()).state == 12 * count_params(SMALL)  # momentum only


@pytest.mark.parametrize(("schedule", "p", "m", "v", "expected"), [
    ("gpipe", 4, 8, 1, 3 / 11),
    ("1f1b", 4, 8, 1, 3 / 11),
    ("1f1b", 2, 1, 1, 1 / 2),
    ("gpipe", 1, 8, 1, 0.0),
    ("interleaved", 4, 8, 2, 1.5 / 9.5),
    ("interleaved", 4, 8, 1, 3 / 11),
    ("zero-bubble", 4, 8, 2, 1 / 9),
    ("pipedream", 4, 8, 1, 0.0),
])
def test_bubble_fraction(schedule, p, m, v, expected):
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected)


def test_ring_allreduce_formula():
    alpha, bw, size = 5e-6, 100e9, 2e9
    for d in (2, 3, 8):
        assert ring_allreduce_seconds(size, d, alpha, bw) == pytest.approx(
            2 * (d - 1) * alpha + 2 * (d - 1) / d * size / bw)
    assert ring_allreduce_seconds(size, 1, alpha, bw) == 0.0


def test_links_follow_the_rank_mapping():
    # 16 H100s, 8 per node: a TP group of 8 fits a node; DP then strides across nodes
    layout = Layout(dp=2, tp=8)
    assert group_link(H100, layout, "tp") == (H100.intra_alpha, H100.intra_bandwidth)
    assert group_link(H100, layout, "dp") == (H100.inter_alpha, H100.inter_bandwidth)
    assert group_link(H100, Layout(dp=4, tp=2), "dp")[1] == H100.intra_bandwidth
    assert group_link(H100, Layout(dp=2, tp=2, pp=4), "pp")[1] == H100.intra_bandwidth
    assert group_link(H100, Layout(dp=1, tp=4, pp=4), "pp")[1] == H100.inter_bandwidth


# --- shapes and monotonicity ---------------------------------------------------------------

@pytest.mark.parametrize("model", [TINY, SMALL, EIGHT_B, ModelConfig(preset="tiny", position="learned")])
def test_stage_parameters_add_up_to_the_model(model):
    assert stage_params(model, Layout(), 0, 64).total == count_params(model)
    tp, d = 2, model.d_model
    stages = [stage_params(model, Layout(tp=tp, pp=2), s, 64) for s in range(2)]
    assert sum(s.layers for s in stages) == model.n_layers
    # norm gains and learned positions are replicated on every tp rank; the rest is split
    learned = model.max_seq_len * d if model.position == "learned" else 0
    replicated = [2 * d * s.layers + (learned if s.first else 0) + (d if s.last else 0) for s in stages]
    tied_copy = model.vocab_size * d if model.tie_embeddings else 0  # the last stage's head
    total = sum((s.total - r) * tp + r for s, r in zip(stages, replicated, strict=True))
    assert total == count_params(model) + tied_copy


def _chunk_parameters(model: ModelConfig, pp: int, schedule: str, rank: int) -> tuple[int, int]:
    """(blocks, parameters) of the chunks the engine builds on pipeline rank `rank` (on the meta device)."""
    from trainer.engine_pipeline import plan_chunks, virtual_stages_of
    from trainer.stages import build_stage, local_chunks, placement_of

    parallel = ParallelConfig(pp=pp, schedule=schedule)
    every = plan_chunks(model, DataConfig(seq_len=64), parallel)
    mine = [every[c] for c in local_chunks(pp, virtual_stages_of(parallel), placement_of(schedule), rank)]
    stages = [build_stage(model, 0, chunk, "meta") for chunk in mine]
    return (sum(len(chunk.layers) for chunk in mine),
            sum(p.numel() for stage in stages for p in stage.parameters()))


# A large vocabulary makes the head worth about two blocks: the FLOP-balanced split gives the
# last stage fewer blocks than the first, which an even split by count would not.
WIDE_HEAD = ModelConfig(vocab_size=1024, n_layers=8, n_heads=4, d_model=64, d_ff=128, max_seq_len=64)


@pytest.mark.parametrize("model", [WIDE_HEAD, WIDE_HEAD.model_copy(update={"tie_embeddings": False}), TINY])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero-bubble"])
def test_stage_parameters_are_the_chunks_the_engine_builds(model, schedule):
    layout = Layout(pp=2, schedule=schedule, virtual_stages=2 if schedule in ("interleaved", "zero-bubble") else 1)
    for rank in range(2):
        params = stage_params(model, layout, rank, 64)
        assert (params.layers, params.total) == _chunk_parameters(model, 2, schedule, rank), (schedule, rank)
    if model is WIDE_HEAD and schedule == "1f1b":
        assert [stage_params(model, layout, r, 64).layers for r in range(2)] == [5, 3]
    if schedule == "zero-bubble" and model.tie_embeddings:  # the V puts both copies of the embedding on rank 0
        first = stage_params(model, layout, 0, 64)
        assert first.first and first.last and first.other_params == 2 * model.vocab_size * model.d_model + model.d_model


def test_stage_flops_add_up_to_flops_per_token():
    for model, tp, pp in ((SMALL, 2, 2), (EIGHT_B, 8, 1), (EIGHT_B, 2, 4), (TINY, 1, 1)):
        work, layout = Workload(model, 512, 8), Layout(tp=tp, pp=pp)
        total = sum(rank_flops_per_token(work, layout, stage_params(model, layout, s, 512)) * tp for s in range(pp))
        assert total == pytest.approx(flops_per_token(model, 512), rel=1e-12)


def test_more_tensor_parallelism_holds_less_state_per_rank():
    work = Workload(EIGHT_B, 2048, 64)
    states = [ledgers(work, Layout(tp=tp)).state for tp in (1, 2, 4, 8)]
    assert states == sorted(states, reverse=True) and states[-1] < states[0] / 6


def test_recomputation_and_sequence_parallel_hold_fewer_activations():
    work = Workload(EIGHT_B, 4096, 64, precision="bf16")
    acts = [ledgers(work, Layout(micro_batch=1, recompute=r)).activation for r in ("none", "selective", "block")]
    assert acts[0] > acts[1] > acts[2]
    with_sp = ledgers(work, Layout(tp=4, micro_batch=1)).activation
    without_sp = ledgers(work, Layout(tp=4, micro_batch=1, sequence_parallel=False)).activation
    assert with_sp < without_sp < acts[0]


def test_gpipe_holds_every_microbatch_1f1b_at_most_p():
    work = Workload(SMALL, 1024, 32)  # 32 microbatches of 1
    for schedule, held in (("gpipe", 32), ("1f1b", 4)):
        layout = Layout(pp=4, micro_batch=1, schedule=schedule)
        first = stage_params(SMALL, layout, 0, 1024)  # 4 of the 12 layers (the head is a stage's worth), no LM head
        per_layer = layer_activation_bytes(work, layout, 1024, "none")
        assert first.layers == 4 and not first.last
        assert m_activation(work, layout, first) == held * 4 * per_layer
    # 1F1B: stage s holds p - s; interleaved (v = 2) stage 0 holds p + (p - 1)/v (Korthikanti, 4.2.3)
    assert [in_flight_microbatches("1f1b", 4, 32, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("interleaved", 4, 32, 0, v=2) == 4 + 3 / 2
    assert in_flight_microbatches("1f1b", 4, 2, 0) == 2  # never more than the step's microbatches


# --- measured on CPU -------------------------------------------------------------------------

def test_state_ledger_matches_a_real_engine():
    train = TrainConfig(steps=5, global_batch=4, micro_batch=2)
    engine = Engine(TINY, DataConfig(seq_len=32), train, ParallelConfig(), rank=0, world_size=1)
    engine.train_step()  # the optimizer's moments exist from the first step on
    batch = engine.data.microbatches(1, 4, 2, 0, 1)[0]
    loss, _ = token_loss_sum(engine.model(batch.input_ids), batch.labels)
    loss.backward()
    held = sum(t.nbytes for t in engine.state_tensors().values())
    held += sum(p.grad.nbytes for p in engine.model.parameters())
    predicted = predicted_ledgers(job(global_batch=4, micro_batch=2, seq_len=32))["state"]
    assert predicted == pytest.approx(held, rel=0.01)


def _saved_for_backward(model_cfg: ModelConfig, precision: str, batch: int, seq: int) -> int:
    """Bytes of the distinct tensors autograd saves in one forward + loss, parameters excluded."""
    model = build_model(model_cfg, seed=0)
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast:
            logits = model(ids)
        token_loss_sum(logits, ids)
    saved.setdefault(logits.untyped_storage().data_ptr(), logits.untyped_storage().nbytes())  # the caller's
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("activation", "norm"), [("gelu", "layernorm"), ("swiglu", "rmsnorm")])
def test_activation_ledger_matches_the_tensors_autograd_saves(precision, activation, norm):
    model_cfg = ModelConfig(preset="tiny", activation=activation, norm=norm)
    batch, seq = 2, 64
    measured = _saved_for_backward(model_cfg, precision, batch, seq)
    work, layout = Workload(model_cfg, seq, batch, precision), Layout(micro_batch=batch)
    predicted = m_activation(work, layout, stage_params(model_cfg, layout, 0, seq), "cpu")
    logits_grad = 4 * batch * seq * model_cfg.vocab_size  # made at backward's start, not saved
    assert predicted - logits_grad == pytest.approx(measured, rel=0.001)


def _net_forward_bytes(model_cfg: ModelConfig, precision: str, recompute: str, batch: int, seq: int) -> int:
    """Bytes a forward + loss leaves allocated (alloc minus free, as torch's profiler counts them)."""
    model = apply_recompute(build_model(model_cfg, seed=0), recompute)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with autocast:
            logits = model(ids)
        token_loss_sum(logits, ids)
    return sum(event.self_cpu_memory_usage for event in prof.events())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["selective", "block"])
@pytest.mark.parametrize(("activation", "norm"), [("gelu", "layernorm"), ("swiglu", "rmsnorm")])
def test_recomputed_layer_ledger_matches_what_a_layer_keeps(precision, recompute, activation, norm):
    # What one more checkpointed layer leaves allocated after the forward: 4 layers minus 2, halved.
    batch, seq = 2, 64
    cfgs = [ModelConfig(preset="tiny", activation=activation, norm=norm, n_layers=n) for n in (4, 2)]
    more, fewer = (_net_forward_bytes(cfg, precision, recompute, batch, seq) for cfg in cfgs)
    work, layout = Workload(cfgs[0], seq, batch, precision), Layout(micro_batch=batch, recompute=recompute)
    predicted = layer_activation_bytes(work, layout, batch * seq, recompute, "cpu")
    assert predicted == pytest.approx((more - fewer) / 2, rel=0.01)


def test_cpu_matmul_peak_is_measured():
    flops = measure_cpu_matmul_flops(seconds=0.2, n=256)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    started = time.perf_counter()
    for _ in range(5):
        a @ b
    naive = 5 * 2 * 256**3 / (time.perf_counter() - started)
    assert naive / 3 < flops < 1e14  # the best batch is at least as fast as a plain timing, roughly


def test_cpu_row_is_measured_and_shared_by_the_ranks_on_the_host():
    cpu = cpu_hardware(("fp32", "bf16"), seconds=0.05)
    assert cpu.kind == "cpu" and cpu.threads == torch.get_num_threads()
    assert cpu.peak("fp32") > 0 and cpu.peak("bf16") > 0 and cpu.hbm_bandwidth > 0 and cpu.intra_bandwidth > 0
    assert 0 < cpu.intra_alpha < 0.01
    assert cpu.host_share(1) <= 1.0
    assert cpu.host_share(4 * cpu.devices_per_node) == pytest.approx(1 / (4 * cpu.threads))
    assert H100.host_share(64) == 1.0
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        hardware("tpu")


# --- prediction and planner ------------------------------------------------------------------

def test_prediction_is_a_consistent_bound():
    spec = job(model=EIGHT_B, seq_len=2048, global_batch=64, micro_batch=1, precision="bf16",
               parallel=ParallelConfig(dp=2, tp=4, pp=1))
    pred = predict_step(spec, H200, 8)
    assert pred.step_s >= max(pred.compute_s, pred.hbm_s) + pred.exposed_comm_s
    tokens = 64 * 2048
    assert pred.tokens_per_s == pytest.approx(tokens / pred.step_s)
    assert pred.mfu == pytest.approx(flops_per_token(EIGHT_B, 2048) * tokens / (pred.step_s * 8 * 989.5e12))
    assert 0 < pred.mfu <= 1
    with pytest.raises(ValueError, match="n_gpus=4"):
        predict_step(spec, H200, 4)


def test_pipeline_bubble_enters_the_step():
    work, layout = Workload(SMALL, 1024, 8), Layout(pp=4, micro_batch=1, schedule="gpipe")
    gpipe = predict(work, layout, H100)
    # the last stage (the LM head's) sets the step: it waits for one microbatch of each stage
    # before it, their compute plus their pipeline sends (the exposed time, equal on every stage)
    upstream = sum(1024 * rank_flops_per_token(work, layout, stage_params(SMALL, layout, s, 1024))
                   for s in range(3)) / H100.peak("fp32")
    assert gpipe.bubble_s == pytest.approx(upstream + 3 * gpipe.exposed_comm_s / 8)
    assert gpipe.step_s == pytest.approx(max(gpipe.compute_s, gpipe.hbm_s) + gpipe.exposed_comm_s + gpipe.bubble_s)
    f = bubble_fraction("gpipe", 4, 8)  # with equal stages it is (p - 1) of them: f / (1 - f) of the step
    assert gpipe.bubble_s <= (gpipe.compute_s + gpipe.exposed_comm_s) * f / (1 - f)


def test_planner_rejects_with_the_right_reasons():
    result = plan(job(model=TINY, global_batch=12, micro_batch=1), H100, 8)
    keys = {key for key, _ in result.rejected_groups()}
    assert "tp=3: 4 heads not divisible by 3" in keys
    # pp need not divide the layers: the engine cuts 4 layers into 3 stages by FLOPs
    assert any(c.layout.pp == 3 for c in plan(job(model=TINY, global_batch=12, micro_batch=1), H100, 3).valid)
    assert "tp*pp=16 exceeds 8 devices" in keys
    assert "dp=8: global_batch 12 not divisible by 8" in keys
    assert "zero>0 with dp=1: nothing to shard (same as zero=0)" in keys
    assert result.valid, "tiny fits on 8 H100s in several layouts"
    for cand in result.valid:
        assert cand.layout.world == 8 and TINY.n_heads % cand.layout.tp == 0
        assert 12 % (cand.layout.dp * cand.layout.micro_batch) == 0
    steps = [c.prediction.step_s for c in result.valid]
    assert steps == sorted(steps)


def test_8b_on_8_h200_ranks_a_fitting_layout_first_and_rejects_plain_ddp_for_memory():
    spec = load_spec(DEMO, ["model.preset=llama3.1-8b"])
    result = plan(spec, H200, 8)
    best = result.valid[0]
    assert best.prediction.memory.total <= capacity_bytes(H200, best.layout)
    ddp = [r for r in result.rejected if (r.layout.dp, r.layout.tp, r.layout.pp, r.layout.zero) == (8, 1, 1, 0)]
    assert ddp and all("out of memory" in r.key and r.memory.total > capacity_bytes(H200, r.layout) for r in ddp)
    assert "state 119.7" in ddp[0].reason  # 8.03B parameters x 16 bytes, in GiB
    assert not [c for c in result.valid if (c.layout.dp, c.layout.tp, c.layout.zero) == (8, 1, 0)]
    assert any((c.layout.dp, c.layout.zero) == (8, 3) for c in result.valid)  # sharding makes dp=8 fit


def test_oom_layouts_fall_back_to_recomputation_first():
    # 8b at 8k tokens on 8 H100s: without recomputation some layouts do not fit, with it they do
    spec = job(model=EIGHT_B, seq_len=8192, global_batch=8, micro_batch=1, precision="bf16")
    result = plan(spec, H100, 8)
    assert {c.layout.recompute for c in result.valid} - {"none"}
    for cand in result.valid:
        if cand.layout.recompute != "none":
            lighter = "none" if cand.layout.recompute == "selective" else "selective"
            assert ledgers(Workload.from_spec(spec), replace(cand.layout, recompute=lighter)).total > \
                capacity_bytes(H100, cand.layout)


def test_predicted_metrics_for_a_spec():
    spec = load_spec(DEMO)
    mem = predicted_ledgers(spec)
    assert set(mem) == {"state", "activation", "collective", "transient"}
    assert mem["state"] == 16 * count_params(spec.model)
    assert mem["collective"] == 4 * count_params(spec.model)  # DDP's bucket copy of the gradients
    assert predicted_bubble_ratio(spec) == 0.0
    piped = job(global_batch=8, micro_batch=1, parallel=ParallelConfig(pp=4, schedule="gpipe"))
    assert predicted_bubble_ratio(piped) == pytest.approx(3 / 11)


def test_plan_command_prints_a_table_and_json(capsys):
    spec = load_spec(DEMO)
    assert plan_main(spec, 8, "h100", as_json=False) == 0
    out = capsys.readouterr().out
    assert "tp=3: 4 heads not divisible by 3" in out and "tokens/s" in out
    assert plan_main(spec, 8, "h100", as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"][0]["prediction"]["step_s"] <= data["valid"][-1]["prediction"]["step_s"]
    assert sum(group["count"] for group in data["rejected"]) + len(data["valid"]) > 100
    assert plan_main(spec, 0, "h100", as_json=False) == 2
    assert capsys.readouterr().err.strip() == "undying plan: --gpus 0: must be at least 1"  # --gpu is fine
    assert plan_main(spec, 8, "tpu", as_json=False) == 2
    assert "--gpu 'tpu': one of" in capsys.readouterr().err
    assert not math.isnan(data["valid"][0]["prediction"]["mfu"])
    # --json: failures are one JSON object on stdout too, a spec's problems listed by field
    assert plan_main(spec, 0, "h100", as_json=True) == 2
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": "undying plan: --gpus 0: must be at least 1", "exit": 2} and not err
    from orchestrator.cli.main import main

    assert main(["plan", DEMO, "--gpus", "8", "--json", "--set", "parallel.dp=0"]) == 2
    out, err = capsys.readouterr()
    assert [p["field"] for p in json.loads(out)["problems"]] == ["parallel.dp"] and not err


def test_the_driver_warns_when_the_cost_model_finds_the_layout_too_big_for_the_cluster_s_gpus():
    from orchestrator.cluster.capacity import device_memory_note
    from trainer.costmodel.hardware import GPUS
    from trainer.costmodel.planner import out_of_memory

    big = load_spec(DEMO, ["model.preset=llama3.1-8b", "resources.gpus_per_rank=1", "parallel.dp=1",
                           "train.global_batch=8", "train.micro_batch=8", "data.seq_len=4096",
                           "checkpoint.memory.enabled=false", "chaos.faults=[]"])
    note = device_memory_note(big, {"GPU": 8.0, "accelerator_type:H200": 1.0, "accelerator_type:H100": 1.0})
    assert note.startswith("the cost model finds this layout too big for one H100 SXM 80GB: needs ")  # the smaller
    assert "`undying plan JOB.yaml --gpus 1 --gpu h100`" in note
    assert out_of_memory(big, GPUS["h100"]) in note
    small = load_spec(DEMO, ["resources.gpus_per_rank=1"])
    assert device_memory_note(small, {"GPU": 8.0, "accelerator_type:H100": 1.0}) is None
    assert device_memory_note(big, {"GPU": 8.0}) is None  # a GPU the table does not know: no guess
    assert device_memory_note(big, {"accelerator_type:A100-40G": 1.0}) is None  # a variant it lacks either
    assert "too big for one A100 SXM 80GB" in device_memory_note(big, {"accelerator_type:A100-80G": 1.0})
    assert device_memory_note(load_spec(DEMO), {"accelerator_type:H100": 1.0}) is None  # CPU ranks


def test_the_driver_warns_when_the_ranks_a_node_would_hold_need_more_than_its_memory():
    from orchestrator.cluster.capacity import host_memory_note
    from trainer.costmodel.layout import Layout, Workload
    from trainer.costmodel.memory import ledgers, runtime_reserve_bytes

    big = load_spec(DEMO, ["model.preset=llama3.2-1b"])  # 4 CPU ranks, ZeRO 0
    layout = Layout.from_spec(big)
    per_rank = ledgers(Workload.from_spec(big), layout, "cpu").total + runtime_reserve_bytes(layout, "cpu")
    # Two nodes: the 8-CPU one would hold all 4 ranks (pack) in 16 GiB, the 2-CPU one 2 in 64 GiB.
    note = host_memory_note(big, [{"CPU": 2.0, "memory": 64 * 2**30}, {"CPU": 8.0, "memory": 16 * 2**30}])
    assert note.startswith(f"the cost model finds 4 rank(s) of this layout on one node need about "
                           f"{4 * per_rank / 2**30:.1f} GiB")
    assert "Ray gives its tasks 16.0 GiB" in note and "parallel.zero: 3" in note and "resources.cpus_per_rank" in note
    sharded = load_spec(DEMO, ["model.preset=llama3.2-1b", "parallel.zero=3"])
    assert "parallel.zero: 3" not in host_memory_note(sharded, [{"CPU": 8.0, "memory": 16 * 2**30}])
    assert host_memory_note(load_spec(DEMO), [{"CPU": 8.0, "memory": 16 * 2**30}]) is None  # the tiny demo fits
    assert host_memory_note(big, [{"CPU": 1.0, "memory": 64 * 2**30}]) is None  # one rank a node: it fits
    assert host_memory_note(load_spec(DEMO, ["resources.gpus_per_rank=1"]), [{"CPU": 8.0, "memory": 1.0}]) is None


def test_the_driver_warns_when_cpu_ranks_run_on_a_cluster_with_gpus():
    from orchestrator.cluster.capacity import cpu_ranks_note

    cpu = load_spec(DEMO)  # resources.gpus_per_rank: 0
    assert cpu_ranks_note(cpu, {"CPU": 16.0, "GPU": 8.0}) == (
        "the cluster has 8 GPU(s), but resources.gpus_per_rank is 0: every rank trains on CPUs (gloo); set "
        "resources.gpus_per_rank: 1 to train on the GPUs")
    placed = load_spec(DEMO, ['resources.custom={"accelerator_type:H100": 0.001}'])
    assert "the ranks ask for accelerator_type:H100, but resources.gpus_per_rank is 0" in cpu_ranks_note(placed, {})
    assert cpu_ranks_note(cpu, {"CPU": 16.0}) is None  # a CPU cluster: nothing to say
    assert cpu_ranks_note(load_spec(DEMO, ["resources.gpus_per_rank=1"]), {"GPU": 8.0}) is None
