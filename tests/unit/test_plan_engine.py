"""Every layout `undying plan` ranks is one the engine runs, and its state ledger is what the
engine would hold.

Hypothesis draws a tiny Llama-like workload (grouped-query attention, SwiGLU, RMSNorm, RoPE,
tied or untied embeddings, any number of layers: pp need not divide it), a device count and a
schedule, and plans it. Then:
  * every ranked layout validates as a job spec (its sections, the cross-section checks and the
    engine's refusals) and passes the engine's construction checks (`check_layout`);
  * one ranked layout is built rank by rank as the engine builds it, on the meta device (no
    memory), in this one process: torch's `fake` process group stands for the world, so the
    tensor-parallel DTensors, FSDP2's shards and ZeRO-1's optimizer partition are the engine's
    own (`build_pipeline` for pp > 1, with the pipeline runner's own checks; `Engine._parallelize`
    for pp = 1). DDP is a stand-in of its class (`MetaDDP`): it wraps the parameters without
    changing them, and its construction cannot run on meta;
  * the bytes each rank would hold at its peak (fp32 parameters and gradients of its local
    shards, gradients unsharded in an FSDP2 pipeline stage, the optimizer state of the
    parameters it steps), averaged over its dp group, equal the cost model's state ledger of
    its pipeline stage; with ZeRO 0 every rank holds exactly that.
    FSDP2 also pads each shard to ceil(rows / dp) rows, which the average leaves out:
    tests/dist/test_state_ledger.py measures real ranks' padded storages (within 5 %).
The default suite draws a few workloads on up to 4 devices; the heavy one many, on up to 8.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

import trainer.engine as engine_module
import trainer.engine_pipeline as engine_pipeline
from orchestrator.spec.job_spec import validate_spec
from tests._fuzz import fuzz
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel import hardware, plan
from trainer.costmodel.layout import Layout, Workload, stage_params
from trainer.costmodel.memory import stage_ledgers
from trainer.data_parallel import SyncClock, build_zero1_optimizer
from trainer.dtensor_slices import local
from trainer.engine import Engine
from trainer.engine_pipeline import LocalChunks, build_pipeline
from trainer.layout_checks import check_layout
from trainer.memory_probe import fsdp_params
from trainer.model import build_model
from trainer.topology import Topology, build_mesh

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream")
H200 = hardware("h200")  # room for every layout of a tiny model: memory rejects none


@st.composite
def workloads(draw, devices: list[int], schedules: tuple[str, ...] = SCHEDULES):
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2]))
    model = ModelConfig(vocab_size=draw(st.sampled_from([48, 64])), n_layers=draw(st.integers(1, 5)), n_heads=heads,
                        n_kv_heads=kv, d_model=8 * heads, d_ff=draw(st.sampled_from([24, 32, 40])), max_seq_len=32,
                        activation="swiglu", norm="rmsnorm", position="rope", tie_embeddings=draw(st.booleans()))
    train = TrainConfig(steps=1, global_batch=draw(st.sampled_from([4, 8, 12])), micro_batch=1,
                        precision=draw(st.sampled_from(["fp32", "bf16"])),
                        optimizer=draw(st.sampled_from(["adamw", "sgd"])))
    spec = SimpleNamespace(model=model, data=DataConfig(seq_len=draw(st.sampled_from([16, 24]))), train=train,
                           parallel=ParallelConfig(schedule=draw(st.sampled_from(schedules))))
    return spec, draw(st.sampled_from(devices))


def parallel_of(layout: Layout) -> ParallelConfig:
    return ParallelConfig(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=layout.zero, schedule=layout.schedule,
                          dp_replicate=layout.dp_replicate,
                          virtual_stages=layout.virtual_stages if layout.pp > 1 else None,
                          recompute=layout.recompute, sequence_parallel=layout.sequence_parallel)


def job_spec(spec, layout: Layout) -> dict:
    model = spec.model.model_dump(exclude_none=True, exclude={"preset", "from_hf"})
    parallel = parallel_of(layout).model_dump(exclude_none=True)
    return {"name": "plan", "model": model, "data": {"source": "synthetic", "seq_len": spec.data.seq_len},
            "train": {**spec.train.model_dump(include={"steps", "global_batch", "precision", "optimizer"}),
                      "micro_batch": layout.micro_batch},
            "parallel": parallel, "checkpoint": {"url": "file:///tmp/undying-plan-test"}}


def assert_the_engine_accepts(spec, layout: Layout) -> None:
    validate_spec(job_spec(spec, layout))  # SpecError if the spec (the engine's refusals included) refuses it
    train = spec.train.model_copy(update={"micro_batch": layout.micro_batch})
    try:
        check_layout(spec.model, spec.data, train, parallel_of(layout), layout.world, 0)
    except RuntimeError as err:  # every refusal passed; only the process group is missing
        assert layout.world > 1 and "init_process_group" in str(err), err


class MetaDDP(DistributedDataParallel):
    """DDP as the pipeline sees it (isinstance: the zero-bubble schedule refuses DDP stages),
    without DDP's construction, which reads parameter values and cannot run on meta."""

    def __init__(self, module: torch.nn.Module, *_args):
        torch.nn.Module.__init__(self)
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@contextmanager
def fake_world(rank: int, world_size: int):
    """A world of `world_size` ranks seen from `rank`, in this process (torch's `fake` backend:
    collectives return at once), with DDP replaced by MetaDDP."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for where in (engine_pipeline, engine_module):
                patch.setattr(where, "wrap_ddp", MetaDDP)
            yield
    finally:
        dist.destroy_process_group()


def built_on_meta(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
                  rank: int) -> tuple[int, torch.nn.Module, list[torch.Tensor]]:
    """(pipeline rank, the rank's model, the parameters its optimizer steps), built as the
    engine builds them (module docstring), on the meta device, inside a fake world."""
    topology = Topology.of(parallel)
    pp_rank, meta = topology.coords(rank).pp, torch.device("meta")
    mesh = build_mesh(topology, "cpu") if parallel.world_size > 1 else None
    if parallel.pp > 1:
        n_micro = train.global_batch // (parallel.dp * train.micro_batch)
        parts = build_pipeline(model, data, train, parallel, mesh=mesh, pp_rank=pp_rank, n_micro=n_micro,
                               device=meta, clock=SyncClock())
        module = LocalChunks(parts.stages)
    else:
        module = build_model(model, seed=train.seed, device=meta)
        fsdp = parallel.zero >= 2 and parallel.dp > 1
        Engine._parallelize(SimpleNamespace(
            parallel_config=parallel, train_config=train, model=module, mesh=mesh, _fsdp=fsdp, device=meta,
            sequence_parallel=parallel.sequence_parallel and parallel.tp > 1, _clock=SyncClock(),
            _dp_group=mesh["dp"].get_group() if mesh is not None else None))
    stepped = list(module.parameters())
    if parallel.zero == 1 and parallel.dp > 1:
        optimizer = build_zero1_optimizer(module, train, mesh["dp"].get_group())
        stepped = [p for group in optimizer.optim.param_groups for p in group["params"]]
    return pp_rank, module, stepped


def held_bytes(module: torch.nn.Module, stepped: list[torch.Tensor], optimizer: str, pipeline: bool) -> int:
    """fp32 parameters and gradients of the local shards, and the optimizer's moments (AdamW:
    two, SGD with momentum: one) of the parameters this rank steps. An FSDP2 pipeline stage
    accumulates its gradients unsharded until the step's reduction: their peak is the
    unsharded size (trainer.memory_probe.state_tensors)."""
    params = sum(local(p).numel() for p in module.parameters())
    records = fsdp_params(module) if pipeline else []
    grads = sum(math.prod(r._orig_size) for r in records) if records else params
    moments = sum(local(p).numel() for p in stepped)
    return 4 * params + 4 * grads + (8 if optimizer == "adamw" else 4) * moments


def check_ranked_layouts(spec, n_gpus: int, pick: int) -> None:
    result = plan(spec, H200, n_gpus)
    # The drawn workloads all fit some layout of 2 or 4 H200s (pure dp at the least): a planner that
    # ranked none would pass every check below without one being made.
    assert result.valid, [r.reason for r in result.rejected][:3]
    for candidate in result.valid:
        assert_the_engine_accepts(spec, candidate.layout)
    # one layout of a drawn kind (degrees > 1 or not, ZeRO stage), so that every kind is built
    kinds = {(c.layout.dp > 1, c.layout.tp > 1, c.layout.pp > 1, c.layout.zero, c.layout.dp_replicate > 1): c.layout
             for c in result.valid}
    layout = list(kinds.values())[pick % len(kinds)]
    parallel = parallel_of(layout)
    train = spec.train.model_copy(update={"micro_batch": layout.micro_batch})
    work = Workload.from_spec(SimpleNamespace(model=spec.model, data=spec.data, train=train))
    held: dict[tuple[int, int], list[int]] = {}  # (pp stage, tp index) -> each dp rank's bytes
    for rank in range(layout.world):
        with fake_world(rank, layout.world):
            stage, module, stepped = built_on_meta(spec.model, spec.data, train, parallel, rank)
        bytes_held = held_bytes(module, stepped, train.optimizer, layout.pp > 1)
        held.setdefault((stage, rank % layout.tp), []).append(bytes_held)
    for (stage, _), per_dp_rank in held.items():
        predicted = stage_ledgers(work, layout, stage, "gpu").state
        assert len(per_dp_rank) == layout.dp
        assert sum(per_dp_rank) / layout.dp == pytest.approx(predicted, abs=1), (layout.label(), stage, per_dp_rank)
        if layout.zero == 0:
            assert set(per_dp_rank) == {predicted}, (layout.label(), stage)


@pytest.mark.parametrize("schedule", SCHEDULES[:4])
def test_every_ranked_pipeline_builds(schedule):
    """Rank 0 of every ranked pp > 1 layout on 4 devices: the pipeline runner refuses what the
    engine's checks missed (DDP or ZeRO-3 stages under zero-bubble, chunks the schedule cannot use)."""
    model = ModelConfig(vocab_size=64, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32, d_ff=32, max_seq_len=32,
                        activation="swiglu", norm="rmsnorm", tie_embeddings=False)
    spec = SimpleNamespace(model=model, data=DataConfig(seq_len=16), train=TrainConfig(steps=1, global_batch=8),
                           parallel=ParallelConfig(schedule=schedule))
    piped = {(c.layout.dp, c.layout.tp, c.layout.pp, c.layout.zero): c.layout
             for c in plan(spec, H200, 4).valid if c.layout.pp > 1}
    assert piped
    for layout in piped.values():
        train = spec.train.model_copy(update={"micro_batch": layout.micro_batch})
        with fake_world(0, layout.world):
            built_on_meta(model, spec.data, train, parallel_of(layout), 0)


@fuzz(8)
@given(workloads(devices=[2, 4], schedules=SCHEDULES[:4]), st.integers(0, 1000))
def test_ranked_layouts_build_and_hold_their_predicted_state(drawn, pick):
    spec, n_gpus = drawn
    check_ranked_layouts(spec, n_gpus, pick)


def test_pipedream_is_never_ranked():
    spec = SimpleNamespace(model=ModelConfig(preset="tiny"), data=DataConfig(seq_len=16),
                           train=TrainConfig(steps=1, global_batch=8), parallel=ParallelConfig(schedule="pipedream"))
    result = plan(spec, H200, 4)
    assert not result.valid and {r.key for r in result.rejected} >= {"pipedream: not run by the engine"}


def test_uneven_layer_split_is_ranked_and_built():
    """5 layers on pp = 2: ranked, priced as the engine cuts them, built, holding what is predicted."""
    model = ModelConfig(vocab_size=64, n_layers=5, n_heads=2, n_kv_heads=1, d_model=16, d_ff=32, max_seq_len=32,
                        activation="swiglu", norm="rmsnorm")
    spec = SimpleNamespace(model=model, data=DataConfig(seq_len=16),
                           train=TrainConfig(steps=1, global_batch=8, micro_batch=1), parallel=ParallelConfig())
    result = plan(spec, H200, 2)
    piped = [c.layout for c in result.valid if c.layout.pp == 2]
    assert piped, [r.reason for r in result.rejected if r.layout.pp == 2]
    layers = [stage_params(model, piped[0], s, 16).layers for s in range(2)]
    assert sorted(layers) == [2, 3], layers
    check_ranked_layouts(spec, 2, [c.layout for c in result.valid].index(piped[0]))


@pytest.mark.heavy
@fuzz(600)
@given(workloads(devices=list(range(1, 9))), st.integers(0, 1000))
def test_ranked_layouts_build_and_hold_their_predicted_state_many(drawn, pick):
    spec, n_gpus = drawn
    check_ranked_layouts(spec, n_gpus, pick)


def test_the_planner_never_turns_recompute_on_under_zero_bubble_and_keeps_the_specs_sequence_parallelism():
    """Zero-bubble's split backward cannot recompute (torch 2.13): a zero-bubble layout too large
    without recompute is rejected, where 1f1b fits it with recompute. And a spec without sequence
    parallelism is priced and checked without it (activations not divided by tp)."""
    model = ModelConfig(preset="llama3.1-8b")
    data, train = DataConfig(seq_len=8192), TrainConfig(steps=1, global_batch=64)
    ranked = {schedule: plan(SimpleNamespace(model=model, data=data, train=train,
                                             parallel=ParallelConfig(schedule=schedule)), H200, 8).valid
              for schedule in ("1f1b", "zero-bubble")}
    assert any(c.layout.recompute != "none" and c.layout.pp > 1 for c in ranked["1f1b"])
    assert all(c.layout.recompute == "none" for c in ranked["zero-bubble"] if c.layout.pp > 1)
    for parallel in (ParallelConfig(), ParallelConfig(sequence_parallel=False)):
        valid = plan(SimpleNamespace(model=model, data=data, train=train, parallel=parallel), H200, 8).valid
        assert valid and {c.layout.sequence_parallel for c in valid} == {parallel.sequence_parallel}


def test_a_validation_longer_than_the_training_windows_rules_out_pipelines_in_the_plan():
    model = ModelConfig(vocab_size=64, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, d_ff=32, max_seq_len=128)
    spec = SimpleNamespace(model=model, data=DataConfig(seq_len=64), train=TrainConfig(steps=1, global_batch=8),
                           parallel=ParallelConfig(), eval=SimpleNamespace(seq_len=128))
    result = plan(spec, H200, 4)
    assert result.valid and all(c.layout.pp == 1 for c in result.valid)  # the spec would refuse them on eval.seq_len
    assert any(r.key.startswith("pp=") and "eval windows" in r.key for r in result.rejected)
    assert any(c.layout.pp > 1 for c in plan(SimpleNamespace(**{**vars(spec), "eval": None}), H200, 4).valid)
