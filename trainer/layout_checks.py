"""What the engine refuses to run, in one place (docs/design.md invariant 7).

`layout_refusals` is the one source of truth: a pure function of the model, the parallel
layout and the batch, with three callers that must agree:
  * `Engine.__init__` calls `check_layout` first thing, before any collective, which raises
    the first refusal, so a bad combination fails on every rank with the same message;
  * the job spec (orchestrator.spec.job_spec.engine_support_problems) reports every refusal
    as a Problem on its field, so a job asking for such a layout is refused before any rank
    starts;
  * the planner (trainer.costmodel.planner) never ranks a layout with a refusal; the first one
    is the reason it shows.
`parallel` is a ParallelConfig or anything with its fields (the planner's Layout). A check
whose input is None is skipped: the spec passes what its valid sections give.

Refused, and why:
  * data.seq_len beyond model.max_seq_len (neither learned positions nor the RoPE tables reach);
  * tp not dividing the heads, the key/value heads, d_ff or the vocabulary (Megatron splits
    each evenly), or sequence parallelism padding the sequence past max_seq_len;
  * a global batch that dp * micro_batch does not divide;
  * HSDP (dp_replicate > 1) whose replica count does not divide dp, with ZeRO 0/1 (DDP
    replicates everything, so there is nothing for a replica to shard), or with one rank per
    replica (again nothing sharded);
  * schedule 'pipedream' at any pp: PipeDream-2BW trains on one-step-stale weights, without
    clipping or data parallelism; it is a different training rule, run by
    trainer.pipedream.PipeDream2BW, never by the engine;
  * train.compile with tp > 1 (torch 2.13's compiled block breaks in the backward of its
    DTensor redistributions, with or without sequence parallelism) or with the zero-bubble
    schedule (it cannot split a compiled block's backward into input and weight halves);
    compile runs with every other layout (trainer.compile);
  * zero-bubble with dp > 1 and zero 0/1 (DDP-wrapped stages: torch 2.13 crashes in the split
    backward) or zero 3 (FSDP2 reshard_after_forward=True: silently wrong gradients). zero 2
    runs it; running zero 3 as zero 2 would hide a memory difference, so it is refused;
  * virtual stages the schedule cannot use (gpipe/1f1b: 1; interleaved: >= 2; zero-bubble: 2),
    more chunks than the layers can fill (trainer.stages.cut_problem; any other count runs,
    split by FLOPs, so pp need not divide n_layers), 1F1B with fewer microbatches than pp,
    and interleaved 1F1B whose microbatches do not split into rounds of pp (torch's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.stages import cut_problem, default_virtual_stages

FIRST_CHUNK_ONLY = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Refusal:
    """One reason the engine will not run a layout. `field` is the spec field to change,
    `message` what is wrong and the fix (read after the field), `key` a short summary equal for
    layouts refused for the same reason (the planner groups its rejected layouts by it)."""

    field: str
    message: str
    key: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def layout_refusals(model: ModelConfig, parallel: Any, seq_len: int | None = None,
                    global_batch: int | None = None, micro_batch: int | None = None,
                    compile: bool = False, eval_len: int | None = None) -> list[Refusal]:
    """Every reason the engine refuses this layout (module docstring), in a fixed order: the
    tensor-parallel split, the sequence, the batch, HSDP, the pipeline, compile (train.compile),
    the validation windows (`eval_len`: eval.seq_len, or data.seq_len; None: no validation).
    Empty when it runs."""
    return (_tensor_parallel(model, parallel, seq_len) + _sequence(model, seq_len)
            + _batch(parallel, global_batch, micro_batch) + _hsdp(parallel)
            + _pipeline(model, parallel, global_batch, micro_batch) + _compile(parallel, compile)
            + _validation(model, parallel, seq_len, eval_len))


def _validation(model: ModelConfig, parallel: Any, seq_len: int | None, eval_len: int | None) -> list[Refusal]:
    if eval_len is None or eval_len > model.max_seq_len:  # (longer than the model: the spec's own check)
        return []
    tp, out = parallel.tp, []
    padded = -(-eval_len // tp) * tp
    if tp > 1 and parallel.sequence_parallel and padded > model.max_seq_len:  # padded as the engine pads it
        out.append(Refusal("eval.seq_len", f"{eval_len} is padded to {padded} (a multiple of parallel.tp = {tp}, "
                           f"for sequence parallelism), beyond model.max_seq_len = {model.max_seq_len}; evaluate "
                           f"windows of at most {model.max_seq_len // tp * tp}", f"tp={tp}: eval windows padded "
                           "past max_seq_len"))
    if seq_len is not None and parallel.pp > 1 and eval_len > seq_len:
        out.append(Refusal("eval.seq_len", f"{eval_len} exceeds data.seq_len = {seq_len}, the static shape of the "
                           "pipeline's stages (pp > 1); evaluate windows of at most data.seq_len tokens",
                           f"pp={parallel.pp}: eval windows longer than the stages' shape"))
    return out


def _compile(parallel: Any, compile: bool) -> list[Refusal]:
    out: list[Refusal] = []
    if compile and parallel.tp > 1:
        out.append(Refusal("train.compile", f"true with parallel.tp = {parallel.tp}: torch 2.13 fails in the backward "
                           "of a compiled tensor-parallel block (a DTensor redistribution receives a plain gradient); "
                           "set train.compile: false, or parallel.tp: 1", f"tp={parallel.tp} with train.compile"))
    if compile and parallel.pp > 1 and parallel.schedule == "zero-bubble":
        out.append(Refusal("train.compile", "true with schedule 'zero-bubble': torch 2.13's schedule cannot split a "
                           "compiled block's backward into its input and weight halves (the input backward fails); "
                           "set train.compile: false, or schedule '1f1b', 'gpipe' or 'interleaved'",
                           "zero-bubble with train.compile"))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


TP_KEYS = {"n_heads": "heads", "n_kv_heads": "key/value heads", "d_ff": "d_ff", "vocab_size": "vocabulary"}


def _tensor_parallel(model: ModelConfig, parallel: Any, seq_len: int | None) -> list[Refusal]:
    tp, out = parallel.tp, []
    if tp == 1:
        return out
    # The fix offered is a tp every split accepts: a divisor of one field alone could fail on another.
    common = math.gcd(*(getattr(model, field) for field in TP_KEYS))
    for field in TP_KEYS:
        value = getattr(model, field)
        if value % tp and not (field == "n_kv_heads" and value == model.n_heads):  # said once for MHA
            out.append(Refusal("parallel.tp", f"model.{field} = {value} is not divisible by tp = {tp}; use a tp "
                               f"that divides heads, key/value heads, d_ff and vocab_size: {_divisors(common)}",
                               f"tp={tp}: {value} {TP_KEYS[field]} not divisible by {tp}"))
    if seq_len is not None and parallel.sequence_parallel:
        padded = -(-seq_len // tp) * tp
        if padded > model.max_seq_len:
            out.append(Refusal("parallel.sequence_parallel", f"pads data.seq_len = {seq_len} to {padded} (a multiple "
                               f"of tp = {tp}), beyond model.max_seq_len = {model.max_seq_len}; raise "
                               "max_seq_len or set sequence_parallel: false",
                               f"tp={tp}: sequence parallelism pads past max_seq_len"))
    return out


def _sequence(model: ModelConfig, seq_len: int | None) -> list[Refusal]:
    if seq_len is None or seq_len <= model.max_seq_len:
        return []
    why = " (learned positions cannot extrapolate)" if model.position == "learned" else ""
    return [Refusal("data.seq_len", f"{seq_len} exceeds model.max_seq_len = {model.max_seq_len}{why}; lower "
                    "data.seq_len or raise model.max_seq_len", f"data.seq_len {seq_len} > max_seq_len")]


def _batch(parallel: Any, global_batch: int | None, micro_batch: int | None) -> list[Refusal]:
    if global_batch is None or micro_batch is None:
        return []
    per_step = parallel.dp * micro_batch
    if global_batch % per_step == 0:
        return []
    nearest = -(-global_batch // per_step) * per_step
    key = (f"dp={parallel.dp}: global_batch {global_batch} not divisible by {parallel.dp}"
           if global_batch % parallel.dp else
           f"dp={parallel.dp} micro_batch={micro_batch}: global_batch {global_batch} not divisible by {per_step}")
    return [Refusal("train.global_batch", f"{global_batch} is not divisible by parallel.dp * train.micro_batch = "
                    f"{per_step}; use a multiple of {per_step} such as {nearest}", key)]


def _hsdp(parallel: Any) -> list[Refusal]:
    replicas, dp, zero = parallel.dp_replicate, parallel.dp, parallel.zero
    if replicas == 1:
        return []
    if dp % replicas:
        return [Refusal("parallel.dp_replicate", f"{replicas} does not divide parallel.dp = {dp} (each replica "
                        f"shards over dp / dp_replicate ranks); use one of {_divisors(dp)}",
                        f"dp_replicate={replicas}: does not divide dp={dp}")]
    if zero < 2:
        return [Refusal("parallel.zero", f"{zero} with parallel.dp_replicate = {replicas}: HSDP shards the state "
                        "inside each replica, and ZeRO 0/1 (DDP) shards no parameters; set parallel.zero to 2 or 3, "
                        "or parallel.dp_replicate to 1", f"dp_replicate={replicas} with zero={zero}")]
    if replicas == dp:
        return [Refusal("parallel.dp_replicate", f"{replicas} = parallel.dp leaves one rank per replica, which "
                        "shards nothing; use a dp_replicate that leaves at least two ranks per replica, or "
                        "parallel.zero 0 (DDP) to replicate everything",
                        f"dp_replicate={replicas}: one rank per replica")]
    return []


def _pipeline(model: ModelConfig, parallel: Any, global_batch: int | None,
              micro_batch: int | None) -> list[Refusal]:
    schedule, pp, dp, zero = parallel.schedule, parallel.pp, parallel.dp, parallel.zero
    if schedule == "pipedream":
        return [Refusal("parallel.schedule", "'pipedream' is asynchronous (one-step-stale weights, no gradient "
                        "clipping, no data parallelism) and does not run in this engine: train with "
                        "trainer.pipedream.PipeDream2BW, or pick gpipe, 1f1b, interleaved or zero-bubble",
                        "pipedream: not run by the engine")]
    if pp == 1:
        return []
    out, virtual = [], parallel.virtual_stages or default_virtual_stages(schedule)
    if schedule in FIRST_CHUNK_ONLY and virtual != 1:
        out.append(Refusal("parallel.virtual_stages", f"{virtual}: schedule {schedule!r} runs one chunk per rank; "
                           "use schedule 'interleaved' for virtual stages", f"{schedule}: virtual stages"))
    if schedule == "interleaved" and virtual < 2:
        out.append(Refusal("parallel.virtual_stages", f"{virtual}: schedule 'interleaved' needs "
                           "parallel.virtual_stages >= 2; use '1f1b' for one", "interleaved: one chunk per rank"))
    if schedule == "zero-bubble" and virtual != 2:
        out.append(Refusal("parallel.virtual_stages", f"{virtual}: schedule 'zero-bubble' (ZB-V) needs exactly 2 "
                           "chunks per rank; set it to 2", "zero-bubble: not 2 chunks per rank"))
    if schedule == "zero-bubble" and dp > 1 and zero in (0, 1):
        out.append(Refusal("parallel.schedule", f"'zero-bubble' with dp={dp} and zero={zero} wraps stages in DDP, "
                           "with which torch 2.13's zero-bubble schedule crashes: use parallel.zero=2",
                           f"zero-bubble with zero={zero} (DDP stages)"))
    if schedule == "zero-bubble" and getattr(parallel, "recompute", "none") != "none":
        out.append(Refusal("parallel.recompute", f"{parallel.recompute!r} with schedule 'zero-bubble': torch 2.13's "
                           "activation checkpointing cannot recompute for the weight half of zero-bubble's split "
                           "backward (it fails); set parallel.recompute: none, or schedule '1f1b' or 'interleaved'",
                           "zero-bubble with recompute"))
    if schedule == "zero-bubble" and dp > 1 and zero == 3:
        out.append(Refusal("parallel.schedule", "'zero-bubble' computes wrong gradients with ZeRO-3 (FSDP2 "
                           "reshard_after_forward=True, torch 2.13): use parallel.zero=2, or schedule '1f1b' "
                           "with zero 3", "zero-bubble with zero=3 (wrong gradients)"))
    cut = cut_problem(model.n_layers, pp * virtual)
    if cut is not None:
        out.append(Refusal("parallel.pp", cut, f"pp={pp} x {virtual} chunks: more than {model.n_layers} layers fill"))
    return out + _microbatches(parallel, global_batch, micro_batch)


def _microbatches(parallel: Any, global_batch: int | None, micro_batch: int | None) -> list[Refusal]:
    if global_batch is None or micro_batch is None or global_batch % (parallel.dp * micro_batch):
        return []  # the batch refusal says it
    schedule, pp = parallel.schedule, parallel.pp
    n_micro = global_batch // (parallel.dp * micro_batch)
    if schedule == "1f1b" and n_micro < pp:
        return [Refusal("parallel.schedule", f"'1f1b' needs at least pp={pp} microbatches per step, got {n_micro}: "
                        "raise train.global_batch or lower train.micro_batch or parallel.dp",
                        "1f1b: fewer microbatches than pp stages")]
    rounds = max(1, n_micro // pp)
    if schedule == "interleaved" and n_micro % rounds:
        return [Refusal("parallel.schedule", f"'interleaved' runs microbatches in rounds of pp={pp}; {n_micro} per "
                        f"step do not split into {rounds} rounds: use a multiple of {pp} microbatches",
                        "interleaved: microbatches not a multiple of microbatches // pp")]
    return []


def check_pipeline(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig) -> None:
    """ValueError with the first pipeline refusal of the layout (schedule, ZeRO, chunks, microbatches)."""
    found = _pipeline(model, parallel, train.global_batch, train.micro_batch)
    if found:
        raise ValueError(str(found[0]))


def check_layout(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
                 world_size: int, rank: int) -> None:
    """ValueError with the first refusal (`layout_refusals`), after the world and rank checks;
    RuntimeError when a world of several ranks has no matching default process group."""
    if world_size != parallel.world_size:
        if parallel.tp == parallel.pp == 1:
            raise ValueError(f"world_size={world_size} but parallel.dp={parallel.dp}: they must be equal")
        raise ValueError(
            f"world_size={world_size} but parallel.dp*tp*pp = {parallel.dp}*{parallel.tp}*{parallel.pp} = "
            f"{parallel.world_size}: make the product equal the number of ranks"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    found = layout_refusals(model, parallel, data.seq_len, train.global_batch, train.micro_batch, train.compile)
    if found:
        raise ValueError(str(found[0]))
    if world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"world_size={world_size} needs torch.distributed.init_process_group first")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"engine rank {rank}/{world_size} does not match the default process "
                f"group's rank {dist.get_rank()}/{dist.get_world_size()}"
            )
