"""What the cost model is asked about: a workload (what is trained) and a layout (how it is cut).

A `Layout` is plain numbers, never a validated JobSpec: the planner builds thousands and asks
trainer.layout_checks.layout_refusals (the engine's own rules, which read a Layout as they
read a ParallelConfig) which of them the engine would refuse.
`Workload.from_spec` / `Layout.from_spec` read any object with the spec's `model`, `data`,
`train` (and `parallel`) sections: a JobSpec or a view of one.

Rank mapping (the engine's, trainer.topology): TP varies fastest, then PP, then DP, so

    rank = (dp_index * pp + pp_index) * tp + tp_index

A TP group is `tp` consecutive ranks (inside one node whenever tp <= GPUs per node), a PP
group strides by `tp`, a DP group by `tp * pp`. `time.py` picks each group's link from this.

Parameters per rank of pipeline rank s of p: the chunks the engine gives it, however unevenly
the layers fall (pp need not divide n_layers; the most loaded stage bounds memory and time). The model is cut
into p * v chunks (v virtual stages per rank, 1 without interleaving) balanced by training
FLOPs, not by layer count (`trainer.stages.split_layers`: the LM head is several blocks' worth
when the vocabulary is large), and chunk c sits on the rank the schedule's placement names
(`trainer.stages.local_chunks`: round robin, or the V shape of zero-bubble, which puts the
first and the last chunk on rank 0). Each chunk holds
  * every block: its projections split over tp (Megatron column/row parallel), its two norm
    gains replicated on every tp rank;
  * the first chunk: the token embedding, vocab-parallel (split over tp), and learned
    positions (replicated);
  * the last chunk: the final norm and the LM head (split over tp). With tied embeddings and
    more than one chunk the last chunk keeps its own copy of the embedding matrix for the
    head, whose gradient is all-reduced with the first chunk's (Megatron-LM's treatment of
    shared embeddings); under the V placement rank 0 thus holds both copies.
With tp = pp = 1 this is exactly `trainer.model.count_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from trainer.config import ModelConfig
from trainer.stages import Chunk, default_virtual_stages, local_chunks, placement_of, split_layers

Recompute = Literal["none", "selective", "block"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "block")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Workload:
    """The training job the layout must run: model shape, tokens per step, numerics."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    precision: str = "fp32"  # "fp32", "bf16" or "fp16"
    optimizer: str = "adamw"  # "adamw" or "sgd"
    compile: bool = False  # train.compile: the engine refuses some layouts with it
    eval_len: int | None = None  # the validation windows' length (None: no validation): some layouts refuse them

    @classmethod
    def from_spec(cls, spec: Any) -> Workload:
        evaluation = getattr(spec, "eval", None)
        return cls(model=spec.model, seq_len=spec.data.seq_len, global_batch=spec.train.global_batch,
                   precision=spec.train.precision, optimizer=spec.train.optimizer, compile=spec.train.compile,
                   eval_len=(evaluation.seq_len or spec.data.seq_len) if evaluation else None)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    """One way to run a workload: degrees, ZeRO stage, microbatch, schedule, recomputation.

    `virtual_stages` is the number of model chunks per pipeline rank (interleaved 1F1B, and
    the V-shaped zero-bubble schedule, which always uses 2). `sequence_parallel` shards the
    norm inputs over tp (Korthikanti et al. 2022, arXiv:2205.05198); it is on whenever tp > 1
    unless turned off here.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = True
    ddp_bucket_mb: float = 25.0
    dp_replicate: int = 1  # HSDP: replicas of dp / dp_replicate ranks, each sharding the state

    @classmethod
    def from_spec(cls, spec: Any) -> Layout:
        par = spec.parallel
        return cls(dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero, micro_batch=spec.train.micro_batch,
                   dp_replicate=par.dp_replicate,
                   schedule=par.schedule,
                   virtual_stages=par.virtual_stages or default_virtual_stages(par.schedule),
                   recompute=par.recompute, sequence_parallel=par.sequence_parallel,
                   ddp_bucket_mb=par.ddp_bucket_mb)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """Ranks the ZeRO 2/3 state is sharded over: dp, or one HSDP replica's dp / dp_replicate."""
        return self.dp // self.dp_replicate

    def microbatches(self, global_batch: int) -> int:
        """Microbatches each pipeline (each dp replica) runs per optimizer step."""
        return max(1, global_batch // (self.dp * self.micro_batch))

    def label(self) -> str:
        dp = f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp}"
        return (f"{dp} tp{self.tp} pp{self.pp} z{self.zero} mb{self.micro_batch}"
                + ("" if self.recompute == "none" else f" rc:{self.recompute}"))

    def to_json(self) -> dict:
        return {"dp": self.dp, "dp_replicate": self.dp_replicate, "tp": self.tp, "pp": self.pp, "zero": self.zero,
                "micro_batch": self.micro_batch, "schedule": self.schedule,
                "virtual_stages": self.virtual_stages, "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel and self.tp > 1}


def rank_of(layout: Layout, dp_index: int, pp_index: int, tp_index: int) -> int:
    """Global rank of a mesh coordinate: TP fastest, then PP, then DP (module docstring)."""
    return (dp_index * layout.pp + pp_index) * layout.tp + tp_index


def group_stride(layout: Layout, dim: str) -> int:
    """Distance in ranks between neighbours of a `dim` ("tp", "pp", "dp", and HSDP's "dp_shard",
    "dp_replicate": a replica is dp_shard consecutive dp indices) group."""
    dp = layout.tp * layout.pp
    return {"tp": 1, "pp": layout.tp, "dp": dp, "dp_shard": dp, "dp_replicate": dp * layout.dp_shard}[dim]


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of pipeline rank `stage` holds (all its chunks), split by role."""

    stage: int
    layers: int
    block_params: int  # projections and norm gains of this rank's blocks
    matmul_params: int  # weights that multiply activations (FLOPs): projections and the LM head
    other_params: int  # embeddings (both copies of a tied one, where the rank holds both), final norm, LM head
    first: bool = True  # holds the first chunk: the embedding lookup
    last: bool = True  # holds the last chunk: the final norm, the LM head and the loss

    @property
    def total(self) -> int:
        return self.block_params + self.other_params


@lru_cache(maxsize=1024)
def _chunks(model: ModelConfig, seq_len: int, n_chunks: int) -> tuple[Chunk, ...]:
    # the planner asks for the same split once per candidate and stage: solve it once
    return tuple(split_layers(model, seq_len, n_chunks))


def stage_params(model: ModelConfig, layout: Layout, stage: int, seq_len: int) -> StageParams:
    """Parameters held by one tp rank of pipeline rank `stage` (see the module docstring).

    `seq_len` enters the balanced split (attention FLOPs grow with it). ValueError where the
    layers do not cut into pp * virtual_stages chunks.
    """
    d, tp, p = model.d_model, layout.tp, layout.pp
    virtual = layout.virtual_stages if p > 1 else 1
    every = _chunks(model, seq_len, p * virtual)
    mine = [every[c] for c in local_chunks(p, virtual, placement_of(layout.schedule), stage)]
    block_matmul = _ceil_div(model.attention_params + model.mlp_params, tp)
    layers = sum(len(chunk.layers) for chunk in mine)
    vocab_shard = _ceil_div(model.vocab_size, tp) * d
    other = head = 0
    for chunk in mine:
        if chunk.first:
            other += vocab_shard + (model.max_seq_len * d if model.position == "learned" else 0)
        if chunk.last:
            other += d + (vocab_shard if not model.tie_embeddings or not chunk.first else 0)
            head = vocab_shard
    return StageParams(stage=stage, layers=layers, block_params=layers * (block_matmul + 2 * d),
                       matmul_params=layers * block_matmul + head, other_params=other,
                       first=any(chunk.first for chunk in mine), last=any(chunk.last for chunk in mine))
