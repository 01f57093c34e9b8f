"""The engine's pipeline-parallel path (pp > 1): this rank's chunks, parallelised, and their runner.

Protocol: `Engine.__init__` calls `build_pipeline(...)` on every rank (collective: TP, FSDP and
DDP set up their groups, in the same order on every rank) instead of building the whole
model. It returns a `PipelineParts`: the chunks this pipeline rank holds (trainer.stages:
`split_layers` over pp * virtual_stages chunks, `local_chunks` by the schedule's placement),
one `StageModel` per chunk, each parallelised in the engine's fixed order (TP -> recompute
-> FSDP2 for zero 2/3, else DDP, localising TP parameters first), and a `PipelineRunner`
over the pp sub-mesh. `LocalChunks` groups the stage models into one module whose parameters
carry the full model's names, so the engine's optimizer, ZeRO-1 partition, state slices
and gradient clipping treat a pipeline rank like a model with fewer parameters.

Per step the engine calls `runner.step` (collective over pp; the data-parallel gradient
reduction happens inside it, in each stage's last backward), then `sync_tied_grads` when
the first and the last chunk share the tied embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.compile import apply_recompute_and_compile
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.costmodel.layout import default_virtual_stages
from trainer.data_parallel import LOW_PRECISION, SyncClock, apply_fsdp, localize_dtensor_params, wrap_ddp
from trainer.init_values import materialize
from trainer.pipeline import PipelineRunner, stage_examples
from trainer.stages import Chunk, StageModel, local_chunks, meta_stage, placement_of, split_layers
from trainer.tensor_parallel import apply_tensor_parallel
from trainer.topology import fsdp_mesh


def virtual_stages_of(parallel: ParallelConfig) -> int:
    """Chunks per pipeline rank: the configured number, else the schedule's default."""
    return parallel.virtual_stages or default_virtual_stages(parallel.schedule)


def pipeline_seq_len(data: DataConfig, parallel: ParallelConfig) -> int:
    """The static sequence length every microbatch is padded to: data.seq_len, rounded up to a
    multiple of tp under sequence parallelism (the stage boundaries carry equal shards)."""
    if parallel.sequence_parallel and parallel.tp > 1:
        return -(-data.seq_len // parallel.tp) * parallel.tp
    return data.seq_len


def plan_chunks(model: ModelConfig, data: DataConfig, parallel: ParallelConfig) -> list[Chunk]:
    """Every chunk of the pipeline (pure; ValueError when the layers do not cut into them)."""
    return split_layers(model, data.seq_len, parallel.pp * virtual_stages_of(parallel))


class LocalChunks(nn.Module):
    """This rank's stage models as one module; its parameters are named as in the full model.

    With tied embeddings and the first and the last chunk on one rank (the V placement),
    `tok_emb.weight` is listed twice, once per copy (distinct tensors). It has no forward:
    the chunks run through the pipeline schedule.
    """

    def __init__(self, stages: list[StageModel]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for stage in self.stages:
            yield from stage.named_parameters(prefix, recurse, remove_duplicate)

    def named_parameters_with_copies(self):
        """(name, parameter, is the tied embedding's second copy) for every local parameter."""
        for stage in self.stages:
            for name, param in stage.named_parameters():
                yield name, param, name in stage.replica_names

    def forward(self, *_args):
        raise RuntimeError("pipeline chunks run through their schedule (Engine.train_step), not as one module")


@dataclass
class PipelineParts:
    chunks: list[Chunk]  # this rank's chunks, in increasing index
    stages: list[StageModel]  # the stage models (unwrapped), one per chunk
    modules: list[nn.Module]  # what the schedule runs: the stage, or its DDP wrapper
    tp_specs: dict  # TP specs of parameters DDP holds as plain local shards (localize_dtensor_params)
    runner: PipelineRunner


def build_pipeline(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig, *,
                   mesh, pp_rank: int, n_micro: int, device: torch.device, clock: SyncClock) -> PipelineParts:
    """This rank's chunks, built, parallelised and scheduled (collective; module docstring)."""
    virtual = virtual_stages_of(parallel)
    every = plan_chunks(model, data, parallel)
    chunks = [every[c] for c in local_chunks(parallel.pp, virtual, placement_of(parallel.schedule), pp_rank)]
    sp = parallel.sequence_parallel and parallel.tp > 1
    fsdp = parallel.zero >= 2 and parallel.dp > 1
    stages, modules, tp_specs = [], [], {}
    for chunk in chunks:
        stage = meta_stage(model, chunk)  # materialised below, only this rank's shards
        module: nn.Module = stage
        if parallel.tp > 1:
            apply_tensor_parallel(stage, mesh["tp"], sp)
            stage.seq_split = parallel.tp if sp else 1
        apply_recompute_and_compile(stage, parallel.recompute, train.compile)
        if fsdp:
            apply_fsdp(stage, fsdp_mesh(mesh, parallel.dp_replicate), parallel.zero, train.precision)
            materialize(stage, train.seed, device)
        else:
            materialize(stage, train.seed, device)  # before DDP's broadcast and the TP-to-local clone
            if parallel.tp > 1:
                tp_specs.update(localize_dtensor_params(stage))
            if parallel.dp > 1:
                module = wrap_ddp(stage, mesh["dp"].get_group(), parallel.ddp_bucket_mb, clock)
        stages.append(stage)
        modules.append(module)
    low = LOW_PRECISION.get(train.precision)
    # Autocast (DDP or no dp) keeps the residual stream fp32; FSDP2's policy computes in `low`.
    amp_dtype = low if not fsdp else None
    hidden_dtype = low if fsdp and low is not None else torch.float32
    seq_len = pipeline_seq_len(data, parallel)
    examples = [stage_examples(model, chunk, train.micro_batch, seq_len, low or torch.float32, hidden_dtype,
                               parallel.tp if sp else 1) for chunk in chunks]
    runner = PipelineRunner(model, chunks, modules, schedule=parallel.schedule, pp=mesh["pp"], n_micro=n_micro,
                            micro_batch=train.micro_batch, seq_len=seq_len, dp_size=parallel.dp, device=device,
                            amp_dtype=amp_dtype, tp_size=parallel.tp, examples=examples)
    return PipelineParts(chunks, stages, modules, tp_specs, runner)
