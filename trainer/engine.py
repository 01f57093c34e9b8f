"""The per-rank training engine: data, tensor and ZeRO parallelism, mixed precision, recomputation.

Protocol (every rank of the default process group, in this order):
  1. Construct an `Engine` with the same configs and its own `rank`. With world_size > 1
     construction is collective (the DeviceMesh's groups, DDP's broadcast, FSDP's groups), so
     the process group (gloo on CPU, nccl on GPU) must already be initialised.
  2. Optionally restore: `load_slices(slices, meta)` (any layout; the slices `wanted_slices()`
     names) or `load_state(tensors, meta)` (whole-tensor layouts). Local, no collectives.
  3. `train_step()` in lockstep on every rank: each call is collective.
  4. Between steps, `state_slices()` / `state_meta()` on any rank. Local, no collectives.
One thread drives an engine; nothing here is thread-safe.

Layout (trainer.topology): rank = (dp * pp + pp_i) * tp + tp_i, a DeviceMesh with dims
("dp", "pp", "tp"); data-parallel collectives use mesh["dp"], tensor-parallel ones mesh["tp"],
the gradient norm and the fp16 overflow flag the whole world. Parallelisms are applied to the
model in a fixed order, one function each:
    1. tensor parallelism      trainer.tensor_parallel.apply_tensor_parallel
    2. recomputation           trainer.recompute.apply_recompute
    3. torch.compile per block trainer.compile.apply_recompute_and_compile (train.compile)
    4. data parallelism        trainer.data_parallel: FSDP2 for zero 2/3, else DDP (+ ZeRO-1)
TP comes first because DDP and FSDP must see the final (sharded) parameters, and
checkpointing before FSDP keeps each block one FSDP unit whose all-gathers the recomputation
reuses. With dp = 1 nothing is replicated, so `zero` changes nothing and is not applied.
Built on the meta device; trainer.init_values materialises only this rank's shards.

Precision: fp32; bf16 and fp16 with fp32 master weights (autocast for DDP, FSDP2's
MixedPrecisionPolicy for zero 2/3); fp16 adds a dynamic loss scaler (trainer.scaler).

Pipeline parallelism (pp > 1, trainer.engine_pipeline): the rank builds only its own chunks
(trainer.stages), each parallelised in the same order, and a `PipelineRunner` replaces
`_forward_backward`'s microbatch loop. `engine.model` is then a `LocalChunks` whose
parameters carry the full model's names; the optimizer (ZeRO-1: one ZeroRedundancyOptimizer
over the dp group) covers all local chunks. The "after_forward" fault point cannot sit inside
a schedule step: with pp > 1 it fires after the runner's step (forwards and backwards done),
just before "after_backward". `StepResult.bubble` is this rank's measured idle fraction of the
schedule (trainer.pipeline.StepTrace). With tied embeddings the last chunk's copy of
`tok_emb.weight` is not saved (the first chunk's is the logical tensor) and is loaded from
the same "model/tok_emb.weight" entry, so checkpoints move between pp degrees.

Bit-exact resume: all randomness is derived from (seed, step, ...) (trainer.seeding), the
data cursor is the step number, the LR schedule is a pure function of the step, and the
reductions have a fixed layout (DDP's buckets: trainer.data_parallel.wrap_ddp; FSDP's
per-block units). So a run restored from `state_slices()` + `state_meta()` into fresh engines
on the same layout continues bit-for-bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.compile import apply_recompute_and_compile
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import Batch, make_cursor, microbatches_per_rank
from trainer.data_parallel import (
    LOW_PRECISION,
    SyncClock,
    apply_fsdp,
    build_zero1_optimizer,
    gradient_sync,
    localize_dtensor_params,
    reshard_gathered,
    wrap_ddp,
)
from trainer.data_wait import slowest_wait
from trainer.device_clock import DeviceClock
from trainer.dtensor_slices import ParamLayout, dtensor_spec, geometry, local, make_grid, scalar_geometry
from trainer.engine_pipeline import LocalChunks, build_pipeline
from trainer.engine_state import STATE_FORMAT, EngineState
from trainer.evaluation import padded_microbatches, shard_windows
from trainer.grad_clip import clip_sharded_grads
from trainer.init_values import materialize
from trainer.layout_checks import check_layout
from trainer.loss import all_reduce_token_loss, token_loss_sum
from trainer.model import meta_model
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from trainer.pipeline import sync_tied_grads
from trainer.scaler import LossScaler
from trainer.seeding import derive_seed
from trainer.tensor_parallel import apply_tensor_parallel, loss_context, pad_to_multiple
from trainer.topology import Topology, build_mesh, fsdp_mesh

FAULT_POINTS = ("before_step", "after_forward", "in_allreduce", "after_backward", "after_optimizer_step")
__all__ = ["FAULT_POINTS", "STATE_FORMAT", "Engine", "StepResult", "check_layout"]


@dataclass
class StepResult:
    step: int  # global step index just computed (0-based)
    loss: float  # token-weighted loss of the whole global batch (same value on every rank)
    tokens: int  # loss tokens in the global batch
    grad_norm: float  # global gradient norm before clipping (inf when the step was skipped)
    lr: float
    compute_s: float  # this rank's forward + backward, excluding the wait on the final gradient sync
    step_s: float  # wall time of the step on this rank
    loss_scale: float = 1.0  # fp16 loss scale this step's backward used (1.0 without a scaler)
    skipped: bool = False  # fp16 overflow: no update was made (the step still counts)
    bubble: float = 0.0  # measured idle fraction of this rank's pipeline schedule (0.0 without pp)
    data_wait_s: float = 0.0  # longest any rank waited for this step's samples (read, or a prefetch in flight)


class Engine(EngineState):
    """One rank's model shard, optimizer and data cursor; `train_step` runs one optimizer step.

    `fault_hook(point, step)`, if set (also assignable later as `engine.fault_hook`), is called
    once per step at each of FAULT_POINTS: before the step, after the last microbatch's
    forward (before the backward that syncs gradients; with pp > 1 after the whole schedule,
    see the module docstring), while the backward's gradient all-reduce is in flight (DDP only:
    on the first bucket DDP hands to the all-reduce, after it was launched; dp = 1 and FSDP never
    reach it), after that backward, and after the optimizer step. `mesh`: this layout's DeviceMesh
    (`build_mesh`) when the caller built it, to record the sockets its groups open; else built here.
    `read_retry`: how the data cursor's remote reads are retried (trainer.tokens.reader; None: not)."""

    def __init__(
        self, model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig, *,
        rank: int, world_size: int, device: str | torch.device = "cpu",
        fault_hook: Callable[[str, int], None] | None = None, mesh=None, read_retry=None,
    ):
        check_layout(model, data, train, parallel, world_size, rank)
        self.device = torch.device(device)
        if train.deterministic:
            # cuBLAS reads this before its first call; without it deterministic mode raises.
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # a NaN memset per empty(): none is read
        self.model_config, self.data_config = model, data
        self.train_config, self.parallel_config = train, parallel
        self.rank, self.world_size = rank, world_size
        self.topology = Topology.of(parallel)
        coords = self.topology.coords(rank)
        self.dp_rank, self.dp_size = coords.dp, parallel.dp
        self.pp_rank, self.pp_size = coords.pp, parallel.pp
        self.tp_rank, self.tp_size = coords.tp, parallel.tp
        self.sequence_parallel = parallel.sequence_parallel and parallel.tp > 1
        self._clock = SyncClock(DeviceClock(self.device))
        self._allreduce_step: int | None = None  # step whose first all-reduced bucket is still to come
        self.fault_hook = fault_hook
        self.n_micro = microbatches_per_rank(train.global_batch, train.micro_batch, parallel.dp)
        self.data = make_cursor(data, model.vocab_size, read_retry)
        self.mesh = mesh if mesh is not None or world_size == 1 else build_mesh(self.topology, self.device.type)
        self._dp_group = self.mesh["dp"].get_group() if self.mesh is not None else None
        self._ddp = None
        self._fsdp = parallel.zero >= 2 and parallel.dp > 1
        self._zero1 = parallel.zero == 1 and parallel.dp > 1
        self.pipeline = None
        if parallel.pp > 1:
            self.pipeline = build_pipeline(model, data, train, parallel, mesh=self.mesh, pp_rank=self.pp_rank,
                                           n_micro=self.n_micro, device=self.device, clock=self._clock)
            self.model = LocalChunks(self.pipeline.stages)
            tp_specs = self.pipeline.tp_specs
        else:
            self.model = meta_model(model)  # materialised by _parallelize, only this rank's shards
            tp_specs = self._parallelize()
        if self._zero1:
            self.optimizer = build_zero1_optimizer(self.model, train, self._dp_group)
        else:
            self.optimizer = build_optimizer(self.model, train)
        # The torch optimizer that holds this rank's state (ZeRO-1: its own partition's).
        self.local_optimizer = self.optimizer.optim if self._zero1 else self.optimizer
        self.layouts = self._describe(tp_specs)
        # Every rank holds every tensor whole: state_tensors() and the local gradient norm work.
        self.whole_state = parallel.tp == parallel.pp == 1 and not self._fsdp and not self._zero1
        self.scaler = LossScaler() if train.precision == "fp16" else None
        self.next_step = 0

    def _parallelize(self) -> dict:
        """Apply TP -> recompute -> data parallelism (module docstring); returns the TP specs of
        parameters that DDP holds as plain local shards."""
        pc, tp_specs = self.parallel_config, {}
        if pc.tp > 1:
            apply_tensor_parallel(self.model, self.mesh["tp"], self.sequence_parallel)
        apply_recompute_and_compile(self.model, pc.recompute, self.train_config.compile)
        if self._fsdp:
            apply_fsdp(self.model, fsdp_mesh(self.mesh, pc.dp_replicate), pc.zero, self.train_config.precision)
            materialize(self.model, self.train_config.seed, self.device)  # FSDP shards only (trainer.init_values)
            return tp_specs
        materialize(self.model, self.train_config.seed, self.device)  # DDP broadcasts, localize clones: values first
        if pc.tp > 1:
            tp_specs = localize_dtensor_params(self.model)
        if pc.dp > 1:
            self._ddp = wrap_ddp(self.model, self._dp_group, pc.ddp_bucket_mb, self._clock)
        return tp_specs

    def _describe(self, tp_specs: dict) -> list[ParamLayout]:
        """Where each parameter's pieces of state sit on the (dp, tp) grid (trainer.dtensor_slices)."""
        grid = make_grid(self.dp_rank, self.dp_size, self.tp_rank, self.tp_size, self.parallel_config.dp_replicate)
        owner = getattr(self.optimizer, "_param_to_rank", None) if self._zero1 else None
        layouts = []
        if isinstance(self.model, LocalChunks):
            named = list(self.model.named_parameters_with_copies())
        else:
            named = [(name, param, False) for name, param in self.model.named_parameters()]
        for name, param, copy in named:
            if name in tp_specs:
                mesh, placements, shape = tp_specs[name]
                spec = (mesh, placements)
            else:
                spec, shape = dtensor_spec(param), tuple(param.shape)
            where = geometry(shape, spec, grid)
            if owner is None:
                optim, step = where, scalar_geometry(grid)
            elif owner[param] == self.dp_rank:
                # ZeRO-1: only the owning dp rank holds the state; tp ranks may hold replicas of it.
                optim, step = geometry(shape, spec, grid, ("tp",)), scalar_geometry(grid, ("tp",))
            else:
                optim = step = None
            layouts.append(ParamLayout(name, param, where, optim, step, copy=copy))
        return layouts

    @property
    def fault_hook(self) -> Callable[[str, int], None] | None:
        return self._fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str, int], None] | None) -> None:
        # The DDP comm hook calls back only when a fault hook is set: unarmed, it tests one None.
        self._fault_hook = hook
        self._clock.in_flight = self._in_allreduce if hook is not None else None

    def _fault(self, point: str, step: int) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point, step)

    def _in_allreduce(self) -> None:
        """DDP launched a gradient bucket's all-reduce (trainer.data_parallel): on the step's first
        bucket, fire "in_allreduce" while that collective is in flight."""
        step, self._allreduce_step = self._allreduce_step, None
        if step is not None:
            self._fault("in_allreduce", step)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # Low-precision compute with fp32 weights: the optimizer always updates fp32 master
        # weights. FSDP2 casts the gathered weights itself (its MixedPrecisionPolicy).
        precision = self.train_config.precision
        if precision in LOW_PRECISION and not self._fsdp:
            return torch.autocast(self.device.type, dtype=LOW_PRECISION[precision])
        return contextlib.nullcontext()

    def _dropout_seed(self, step: int) -> int:
        # Dropout draws from the global generator; reseeding it per step means a resumed run
        # needs no RNG state from the checkpoint. Without sequence parallelism the tp ranks
        # must draw identical masks (their activations are replicas; attention dropout over
        # each rank's own heads is salted apart, model.CausalSelfAttention); with it each holds a
        # different part of the sequence and draws its own. Pipeline stages hold different
        # layers, so they draw independent masks (the masks differ from one process's).
        where = (self.dp_rank,) if self.pp_size == 1 else (self.dp_rank, "pp", self.pp_rank)
        if self.sequence_parallel:
            return derive_seed(self.train_config.seed, "dropout", step, *where, "tp", self.tp_rank)
        return derive_seed(self.train_config.seed, "dropout", step, *where)

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch of step `next_step`; collective."""
        step, tc = self.next_step, self.train_config
        started = time.perf_counter()
        self._fault("before_step", step)
        self._allreduce_step = step
        torch.manual_seed(self._dropout_seed(step))
        batches = self.data.microbatches(step, tc.global_batch, tc.micro_batch, self.dp_rank, self.dp_size)
        data_wait_s = slowest_wait(self.data.last_wait_s, self.world_size, self.device)
        if self.sequence_parallel:
            batches = [pad_to_multiple(batch, self.tp_size) for batch in batches]
        local_tokens = sum(batch.n_tokens for batch in batches)
        global_tokens = self._sum_over_dp(local_tokens)
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        self._clock.start_compute()
        self._trace = None
        if self.pipeline is not None:
            loss_sum = self._pipeline_forward_backward(step, batches, global_tokens, loss_scale)
            compute_s = self._trace.busy_s
        else:
            loss_sum = self._forward_backward(step, batches, global_tokens, loss_scale)
            compute_s = self._clock.compute_seconds(self._ddp is not None)
        self._fault("after_backward", step)
        skipped, grad_norm = self._finish_gradients(step)
        lr = lr_at(step, tc)
        set_lr(self.optimizer, lr)
        if not skipped:
            self.optimizer.step()
        for param in self.model.parameters():
            param.grad = None
        self.next_step = step + 1
        self._fault("after_optimizer_step", step)
        if self.dp_size > 1:
            loss_sum, _ = all_reduce_token_loss(loss_sum, local_tokens, group=self._dp_group, device=self.device)
        return StepResult(
            step=step, loss=loss_sum / global_tokens, tokens=global_tokens, grad_norm=grad_norm,
            lr=lr, compute_s=compute_s, step_s=time.perf_counter() - started,
            loss_scale=loss_scale, skipped=skipped,
            bubble=self._trace.idle_fraction() if self._trace is not None else 0.0,
            data_wait_s=data_wait_s,
        )

    @torch.no_grad()
    def evaluate(self, windows: list[torch.Tensor], between: Callable[[], None] = lambda: None) -> tuple[float, int]:
        """(summed token loss, tokens) of `windows` (trainer.evaluation's, the same on every rank); collective
        over the job. Each dp replica evaluates its share, padded to one microbatch count on every rank
        (FSDP and the pipeline run collectives per forward); `between()` before each (it may raise: an abort)."""
        mb, seq = self.train_config.micro_batch, int(windows[0].numel()) - 1
        rounds = self.pipeline.runner.n_micro if self.pipeline is not None else 1
        per_rank = -(-len(windows) // self.dp_size)
        count = -(-per_rank // (mb * rounds)) * rounds  # microbatches, the same on every rank
        width = -(-seq // self.tp_size) * self.tp_size if self.sequence_parallel else seq
        batches = padded_microbatches(shard_windows(windows, self.dp_rank, self.dp_size), mb, count, width)
        total, tokens = 0.0, sum(b.n_tokens for b in batches)
        self.model.train(False)  # no dropout
        try:
            total = self._evaluate_batches(batches, rounds, between)
        finally:
            self.model.train(True)
            reshard_gathered(self.model)  # ZeRO-2 keeps a forward's gathered parameters until a backward
        if self.dp_size > 1:
            total, tokens = all_reduce_token_loss(total, tokens, group=self._dp_group, device=self.device)
        return total, tokens

    def _evaluate_batches(self, batches: list[Batch], rounds: int, between: Callable[[], None]) -> float:
        total = 0.0
        for start in range(0, len(batches), rounds):
            between()
            if self.pipeline is not None:
                total += self.pipeline.runner.step(batches[start:start + rounds], 1, forward_only=True).loss_sum
                continue
            with self._autocast(), loss_context(self.tp_size):
                part, _ = token_loss_sum(self.model(batches[start].input_ids.to(self.device)),
                                         batches[start].labels.to(self.device))
            total += float(local(part))
        return total

    def _sum_over_dp(self, count: int) -> int:
        # Every tp rank of a dp replica reads the same samples: count them once per replica.
        if self.dp_size == 1:
            return count
        total = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self._dp_group)
        return int(total)

    def _forward_backward(self, step: int, batches: list[Batch], global_tokens: int, loss_scale: float) -> float:
        """Accumulate the gradient of loss_scale * (sum of all token losses of the step) / global_tokens.

        DDP and FSDP average gradients over the dp ranks, so each rank scales its loss sums by
        dp_size / global_tokens. DDP reduces only in the last microbatch's backward; FSDP2
        reduce-scatters every microbatch's (trainer.data_parallel.gradient_sync).
        Returns this rank's summed token loss (over its dp replica's samples).
        With pp > 1 `_pipeline_forward_backward` takes this method's place, with the same
        loss, scaling and return value; each stage reduces its gradients once, after the schedule.
        """
        scale = loss_scale * self.dp_size / global_tokens
        module = self._ddp if self._ddp is not None else self.model
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, batch in enumerate(batches):
            last = k == len(batches) - 1
            with gradient_sync(self._ddp, self.model if self._fsdp else None, last):
                with self._autocast():
                    logits = module(batch.input_ids.to(self.device))
                with loss_context(self.tp_size):
                    part, _ = token_loss_sum(logits, batch.labels.to(self.device))
                    if last:
                        self._fault("after_forward", step)
                    (part * scale).backward()
            loss_sum += local(part.detach())
        return float(loss_sum)

    def _pipeline_forward_backward(self, step: int, batches: list[Batch], global_tokens: int,
                                   loss_scale: float) -> float:
        """`_forward_backward` through the pipeline schedule (collective over pp).
        The runner applies the same loss and scale (under `loss_context(tp)`), and each stage's
        DDP / FSDP reduces its gradients once, in its last backward. Then the tied embedding's
        two copies sum their gradients. Returns the pipeline's loss sum on every stage.
        """
        out = self.pipeline.runner.step(batches, global_tokens, loss_scale)
        self._trace = out.trace
        self._fault("after_forward", step)  # after the whole schedule: see the module docstring
        sync_tied_grads(self.pipeline.stages, self.mesh["pp"], self.parallel_config.schedule)
        return out.loss_sum

    def _finish_gradients(self, step: int) -> tuple[bool, float]:
        """fp16: unscale and check for overflow (skip the step); then the global norm and clipping."""
        if self.scaler is not None:
            grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
            found_inf = self.scaler.unscale_(grads, device=self.device)
            self.scaler.update(found_inf, step)
            if found_inf:
                return True, float("inf")
        clip = self.train_config.grad_clip
        if self.whole_state:
            return False, clip_grad_norm(self.model.parameters(), clip)
        return False, clip_sharded_grads(self.layouts, clip)
