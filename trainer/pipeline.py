"""One optimizer step's forward and backward through a pipeline, on torch.distributed.pipelining.

Protocol, on every rank of one pipeline (pp) group, per optimizer step and in this order:
  1. `runner.step(batches, global_tokens)`: collective over the pp group. Runs the schedule
     over this rank's chunks, accumulates the gradient of (sum of token losses) / global
     tokens into the stage modules, and returns the step's summed token loss on every rank
     of the group (the last chunk computes it; one all-reduce shares it).
  2. `sync_tied_grads(...)` when embeddings are tied and pp > 1 (collective over the pp
     group between the ranks of the first and the last chunk; a no-op elsewhere).
  3. The global gradient norm and clipping, over every chunk and every shard of the model
     (trainer.grad_clip.clip_sharded_grads, as the engine does; collective over the world).
  4. The optimizer step, on each rank over its own chunks' parameters.
Every rank of the pp group receives the same `batches` (the data cursor is deterministic);
only the ranks of the first and the last chunk read them. One thread drives a runner.

Schedules (torch 2.13): gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B (one chunk per rank),
interleaved -> ScheduleInterleaved1F1B (virtual_stages >= 2, round-robin placement),
zero-bubble -> ScheduleZBVZeroBubble (exactly two chunks per rank, V placement). Both
zero-bubble schedules torch ships match the single-process reference on CPU/gloo
(ScheduleInterleavedZeroBubble, i.e. ZB-H1 with round-robin chunks, was checked too); ZB-V
is the one used because, at 1F1B's activation memory, its bubble is the smaller one (ZB-H1
keeps about a third of 1F1B's; ZB-V approaches none when forward, input-gradient and
weight-gradient passes take equal time; Qi et al. 2024, arXiv:2401.10241, sections 3 and 6),
because it puts the first and the last chunk on rank 0, so a tied embedding's two copies
sum their gradients without a message, and because it is the layout the cost model prices
(`default_virtual_stages` = 2). The zero-bubble schedules split each backward into input and
weight gradients; they crash with DDP-wrapped stages and are silently wrong with FSDP2
reshard_after_forward=True (torch 2.13 probes, docs/design.md section 5), so the runner refuses
both; with FSDP2 reshard_after_forward=False (ZeRO-2) they match the reference.

Loss: token-weighted (trainer/loss.py). The schedule's loss function returns
token_loss_sum * dp_size / global_tokens per microbatch (the data-parallel reduction of DDP
and FSDP averages over dp, hence the dp_size), and grads are not rescaled by the schedule
(scale_grads=False). Every microbatch is padded to seq_len (static shapes; padding at the
end changes no real token's causal attention, and its labels are IGNORE_INDEX).

Measurement: every forward (F), backward (B; zero-bubble: input I and weight W) and loss
(L) action is timed on this rank, as the device ran it (trainer.device_clock: CUDA events on a
GPU). The step window runs from a barrier of the pp group before the schedule to the loss
all-reduce after it, so every rank's window is the same wall-clock span and
`StepTrace.idle_fraction` is that rank's share of the bubble.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ModelConfig
from trainer.data import Batch
from trainer.device_clock import DeviceClock
from trainer.loss import IGNORE_INDEX, token_loss_sum
from trainer.stages import Chunk, StageModel, chunk_ranks, placement_of
from trainer.tensor_parallel import loss_context

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
}
SINGLE_CHUNK = ("gpipe", "1f1b")


def as_group(pp: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """The process group of `pp`: a group as is, or a one-dimensional (sub-)mesh's group."""
    return pp.get_group() if isinstance(pp, DeviceMesh) else pp


def pad_batch(batch: Batch, seq_len: int) -> Batch:
    """`batch` right-padded to `seq_len` (token 0, label IGNORE_INDEX): every microbatch one shape."""
    width = batch.input_ids.shape[1]
    if width > seq_len:
        raise ValueError(f"microbatch of {width} tokens is longer than data.seq_len={seq_len}")
    if width == seq_len:
        return batch
    pad = (0, seq_len - width)
    return Batch(torch.nn.functional.pad(batch.input_ids, pad, value=0),
                 torch.nn.functional.pad(batch.labels, pad, value=IGNORE_INDEX))


def stage_examples(cfg: ModelConfig, chunk: Chunk, micro_batch: int, seq_len: int,
                   logits_dtype: torch.dtype = torch.float32, hidden_dtype: torch.dtype = torch.float32,
                   seq_split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) example tensors of `chunk` for a static-shape PipelineStage.

    Hidden states cross stage boundaries in fp32 under autocast (the residual stream stays
    fp32); FSDP2's low-precision policy makes them `hidden_dtype`. Under sequence parallelism
    a boundary carries this tp rank's 1/seq_split of the sequence (a plain local tensor).
    Float examples carry requires_grad=True: in static mode torch derives from it which
    gradients a stage receives (outputs) and sends back (inputs).
    """
    hidden = (micro_batch, seq_len // seq_split, cfg.d_model)
    if chunk.first:
        inputs = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    else:
        inputs = torch.empty(hidden, dtype=hidden_dtype, requires_grad=True)
    if chunk.last:
        outputs = torch.empty(micro_batch, seq_len, cfg.vocab_size, dtype=logits_dtype, requires_grad=True)
    else:
        outputs = torch.empty(hidden, dtype=hidden_dtype, requires_grad=True)
    return inputs, outputs


@dataclass(frozen=True)
class ActionEvent:
    kind: str  # F forward, B full backward, I input-gradient backward, W weight backward, L loss
    chunk: int
    micro: int
    start: float  # time.perf_counter() seconds (a DeviceClock mark until the step settles it)
    end: float


@dataclass
class StepTrace:
    """The timed actions of one rank in one step, inside the step's window."""

    events: list[ActionEvent] = field(default_factory=list)
    window_start: float = 0.0
    window_end: float = 0.0

    @property
    def busy_s(self) -> float:
        return sum(e.end - e.start for e in self.events)

    def idle_fraction(self) -> float:
        """1 - busy / window: waiting for neighbours, communication and the fill/drain bubble."""
        window = self.window_end - self.window_start
        return max(0.0, 1.0 - self.busy_s / window) if window > 0 else 0.0

    def settle(self, clock: DeviceClock, opened, opened_host: float, closed) -> None:
        """The actions' marks as times of the host's clock (one clock across the ranks' processes,
        so their events compare), anchored at the window's opening (`opened`, taken at host time
        `opened_host`), once `closed` is recorded."""
        at = lambda mark: clock.host_time(mark, opened, opened_host)  # noqa: E731
        self.events = [replace(e, start=at(e.start), end=at(e.end)) for e in self.events]
        self.window_start, self.window_end = opened_host, at(closed)

    def max_in_flight(self) -> int:
        """Most (chunk, microbatch) pairs whose forward was done and whose backward was not.

        The activations a rank holds: released by a full backward (B), or by the weight
        backward (W) of a split one, whose input backward (I) still needs them.
        """
        live, most = 0, 0
        for event in sorted(self.events, key=lambda e: e.start):
            if event.kind == "F":
                live += 1
                most = max(most, live)
            elif event.kind in ("B", "W"):
                live -= 1
        return most


@dataclass(frozen=True)
class StepOutput:
    loss_sum: float  # summed token loss of the pipeline's microbatches (same on every pp rank)
    trace: StepTrace


def _uses_fsdp_reshard_after_forward(module: nn.Module) -> bool:
    # FSDP2 keeps no public flag; a param group reshards after forward iff it has a
    # post-forward mesh (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
    for sub in module.modules():
        state = getattr(sub, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        if group is not None and group.post_forward_mesh_info is not None:
            return True
    return False


class PipelineRunner:
    """The pipeline schedule of this rank's chunks; `step` runs one optimizer step's microbatches.

    `modules[k]` runs `chunks[k]` (this rank's chunks, in increasing index, as `local_chunks`
    gives them) and may be a plain StageModel or one wrapped by DDP, FSDP2 or tensor
    parallelism; only nn.Module is assumed. `pp` is the pipeline group (or mesh["pp"]), never
    assumed to be the default group. `examples[k]` overrides `stage_examples` for chunk k
    (e.g. DTensor boundaries under sequence parallelism).
    """

    def __init__(self, cfg: ModelConfig, chunks: Sequence[Chunk], modules: Sequence[nn.Module], *,
                 schedule: str, pp: dist.ProcessGroup | DeviceMesh, n_micro: int, micro_batch: int,
                 seq_len: int, dp_size: int = 1, device: str | torch.device = "cpu",
                 amp_dtype: torch.dtype | None = None, tp_size: int = 1,
                 examples: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None):
        if schedule not in SCHEDULE_CLASSES:
            raise ValueError(
                f"parallel.schedule={schedule!r} is not a synchronous pipeline schedule; expected one of "
                f"{sorted(SCHEDULE_CLASSES)} ('pipedream' runs through trainer.pipedream)"
            )
        self.group = as_group(pp)
        self.pp_size, self.pp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.chunks, self.modules = list(chunks), list(modules)
        self.n_chunks = self.pp_size * len(self.chunks)
        self.n_micro, self.micro_batch, self.seq_len = n_micro, micro_batch, seq_len
        self._check_layout(schedule)
        self.dp_size, self.amp_dtype, self.tp_size = dp_size, amp_dtype, tp_size
        self.device = torch.device(device)
        self.clock = DeviceClock(self.device)
        self._scale = 0.0
        self._parts: list[torch.Tensor] = []
        self.trace = StepTrace()
        logits_dtype = amp_dtype or torch.float32
        stages = []
        for k, (chunk, module) in enumerate(zip(self.chunks, self.modules, strict=True)):
            inputs, outputs = (examples[k] if examples is not None
                               else stage_examples(cfg, chunk, micro_batch, seq_len, logits_dtype))
            stage = PipelineStage(module, chunk.index, self.n_chunks, self.device, input_args=inputs,
                                  output_args=outputs, group=self.group)
            self._instrument(stage)
            stages.append(stage)
        self.holds_first = any(chunk.first for chunk in self.chunks)
        self.holds_last = any(chunk.last for chunk in self.chunks)
        schedule_cls = SCHEDULE_CLASSES[schedule]
        target = stages[0] if schedule in SINGLE_CHUNK else stages
        self.schedule = schedule_cls(target, n_micro, loss_fn=self._loss, scale_grads=False)

    def _check_layout(self, schedule: str) -> None:
        virtual = len(self.chunks)
        if schedule in SINGLE_CHUNK and virtual != 1:
            raise ValueError(f"schedule {schedule!r} runs one chunk per rank, got {virtual}: "
                             "use parallel.schedule='interleaved' for virtual stages")
        if schedule == "1f1b" and self.n_micro < self.pp_size:
            raise ValueError(f"schedule '1f1b' needs at least pp={self.pp_size} microbatches per step, got "
                             f"{self.n_micro}: raise train.global_batch or lower train.micro_batch or parallel.dp")
        if schedule == "interleaved" and virtual < 2:
            raise ValueError("schedule 'interleaved' needs parallel.virtual_stages >= 2 (got 1): "
                             "set virtual_stages, or use '1f1b'")
        if schedule == "zero-bubble":
            if virtual != 2:
                raise ValueError(f"schedule 'zero-bubble' (ZB-V) needs exactly 2 chunks per rank, got {virtual}: "
                                 "set parallel.virtual_stages=2")
            if any(isinstance(m, DistributedDataParallel) for m in self.modules):
                raise ValueError("schedule 'zero-bubble' does not run with DDP-wrapped stages (torch 2.13 "
                                 "crashes): use parallel.zero=2 (FSDP2 without resharding) or another schedule")
            if any(_uses_fsdp_reshard_after_forward(m) for m in self.modules):
                raise ValueError("schedule 'zero-bubble' computes wrong gradients with FSDP2 "
                                 "reshard_after_forward=True (torch 2.13): shard with reshard_after_forward=False")
        expected = chunk_ranks(self.pp_size, virtual, placement_of(schedule))
        for chunk in self.chunks:
            if expected[chunk.index] != self.pp_rank:
                raise ValueError(f"chunk {chunk.index} belongs to pipeline rank {expected[chunk.index]} under "
                                 f"schedule {schedule!r}, not to rank {self.pp_rank}: build chunks with local_chunks")

    def _instrument(self, stage: PipelineStage) -> None:
        """Time each forward/backward action the schedule runs on `stage` (instance attributes)."""
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            original = getattr(stage, name)

            def timed(micro, *args, _run=original, _kind=kind, _chunk=stage.stage_index, **kwargs):
                start = self.clock.mark()
                out = _run(micro, *args, **kwargs)
                split = _kind == "B" and kwargs.get("full_backward", True) is False
                self.trace.events.append(ActionEvent("I" if split else _kind, _chunk, micro, start,
                                                     self.clock.mark()))
                return out

            setattr(stage, name, timed)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        start = self.clock.mark()
        part, _ = token_loss_sum(logits, labels)
        # under loss_parallel a Replicate DTensor: every tp rank holds the whole sum
        self._parts.append(part.detach().to_local() if isinstance(part, DTensor) else part.detach())
        scaled = part * self._scale
        self.trace.events.append(ActionEvent("L", self.chunks[-1].index, len(self._parts) - 1, start,
                                             self.clock.mark()))
        return scaled

    def step(self, batches: Sequence[Batch], global_tokens: int, loss_scale: float = 1.0,
             forward_only: bool = False) -> StepOutput:
        """Forward and backward of `batches` (this pipeline's microbatches); collective over pp.

        Gradients accumulate into the stage modules' .grad (zero them before the step).
        `global_tokens` is the loss-token count of the whole global batch, over every dp rank;
        `loss_scale` multiplies the loss whose gradient is taken (fp16 loss scaling), not the
        returned loss sum. With tp_size > 1 the schedule runs under `loss_parallel`, the
        loss's backward included (the logits are vocabulary-sharded DTensors). `forward_only`
        (evaluation): the schedule's forward passes alone, no gradient; padding-only batches allowed.
        """
        if len(batches) != self.n_micro:
            raise ValueError(f"expected {self.n_micro} microbatches, got {len(batches)}")
        if global_tokens <= 0 and not forward_only:
            raise ValueError("no loss tokens: every label of the global batch is padding")
        padded = [pad_batch(batch, self.seq_len) for batch in batches]
        for batch in padded:
            if batch.input_ids.shape[0] != self.micro_batch:
                raise ValueError(f"microbatch of {batch.input_ids.shape[0]} samples, expected {self.micro_batch}")
        args = (torch.cat([b.input_ids for b in padded]).to(self.device),) if self.holds_first else ()
        target = torch.cat([b.labels for b in padded]).to(self.device) if self.holds_last else None
        self._scale, self._parts = loss_scale * self.dp_size / max(global_tokens, 1), []
        self.trace = StepTrace()
        dist.barrier(group=self.group)
        opened, opened_host = self.clock.opening()
        amp = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else contextlib.nullcontext()
        with amp, loss_context(self.tp_size), torch.set_grad_enabled(not forward_only):
            run = self.schedule.eval if forward_only else self.schedule.step
            run(*args, target=target, return_outputs=False)
        local = torch.stack(self._parts).double().sum() if self._parts else torch.zeros((), dtype=torch.float64)
        total = local.reshape(1).to(self.device)
        # only the last chunk's rank contributes: x + 0 is exact, so every rank gets its sum
        dist.all_reduce(total, group=self.group)
        closed = self.clock.mark()
        loss_sum = float(total)  # waits for the step's work: the marks before are all recorded by now
        self.trace.settle(self.clock, opened, opened_host, closed)
        return StepOutput(loss_sum=loss_sum, trace=self.trace)


def _tied_weight(stage: StageModel) -> nn.Parameter:
    # The registered parameter: under DDP x TP (trainer.data_parallel.localize_dtensor_params)
    # attribute lookup finds the forward's DTensor view, which holds no gradient.
    return stage.tok_emb._parameters["weight"]


def _grad_local(param: nn.Parameter) -> torch.Tensor:
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def sync_tied_grads(stage_models: Sequence[StageModel], pp: dist.ProcessGroup | DeviceMesh,
                    schedule: str) -> None:
    """Sum the tied embedding's gradient over its two copies (first and last chunk); collective over pp.

    Call after `runner.step` (after any data-parallel gradient reduction) and before clipping.
    Both copies end with grad_first + grad_last, added in that order on both ranks, so they
    stay bit-identical. No-op unless embeddings are tied and the first and last chunks differ.
    """
    group = as_group(pp)
    if not stage_models or not stage_models[0].cfg.tie_embeddings:
        return
    pp_size, virtual = dist.get_world_size(group), len(stage_models)
    if pp_size * virtual == 1:
        return
    ranks = chunk_ranks(pp_size, virtual, placement_of(schedule))
    first_rank, last_rank = ranks[0], ranks[-1]
    first = next((m for m in stage_models if m.is_first), None)
    last = next((m for m in stage_models if m.is_last), None)
    if first is not None and last is not None:
        total = _grad_local(_tied_weight(first)) + _grad_local(_tied_weight(last))
        _grad_local(_tied_weight(first)).copy_(total)
        _grad_local(_tied_weight(last)).copy_(total)
        return
    mine = first if first is not None else last
    if mine is None:
        return
    grad = _grad_local(_tied_weight(mine))
    peer = last_rank if first is not None else first_rank
    theirs = torch.empty_like(grad)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grad, group=group, group_peer=peer),
                                    dist.P2POp(dist.irecv, theirs, group=group, group_peer=peer)])
    for work in works:
        work.wait()
    grad.copy_(grad + theirs if first is not None else theirs + grad)
