"""The per-rank training engine: data parallelism with DDP over the default process group.

Protocol (every rank of the default process group, in this order):
  1. Construct an `Engine` with the same configs and its own `rank`. With world_size > 1
     construction is collective (DDP broadcasts rank 0's parameters and checks shapes), so
     the process group (gloo on CPU, nccl on GPU) must already be initialised.
  2. Optionally `load_state(tensors, meta)` with the same checkpoint on every rank. Local.
  3. `train_step()` in lockstep on every rank: each call is collective (the token count,
     the gradient all-reduce inside DDP's last backward, the reported loss).
  4. Between steps, `state_tensors()` / `state_meta()` on any rank. Local, no collectives;
     on DDP every rank holds the whole replicated state.
One thread drives an engine; nothing here is thread-safe.

Bit-exact resume: all randomness is derived from (seed, step, ...) (trainer.seeding), the
data cursor is the step number, the LR schedule is a pure function of the step, and the
gradient bucket layout is fixed at construction (see `_wrap_ddp`). So a run restored from
`state_tensors()` + `state_meta()` into fresh engines on the same layout continues bit-for-bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import Batch, DataCursor, microbatches_per_rank
from trainer.loss import all_reduce_token_loss, token_loss_sum
from trainer.model import build_model
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from trainer.seeding import derive_seed
from trainer.state_slices import TensorSlice, whole

FAULT_POINTS = ("before_step", "after_forward", "after_backward", "after_optimizer_step")
STATE_FORMAT = "undying.trainer/1"


@dataclass
class StepResult:
    step: int  # global step index just computed (0-based)
    loss: float  # token-weighted loss of the whole global batch (same value on every rank)
    tokens: int  # loss tokens in the global batch
    grad_norm: float  # global gradient norm before clipping
    lr: float
    compute_s: float  # this rank's forward + backward, excluding the wait on the final gradient sync
    step_s: float  # wall time of the step on this rank


def check_layout(parallel: ParallelConfig, world_size: int, rank: int) -> None:
    """The layouts this engine runs: pure data parallelism, one rank per dp replica."""
    if (parallel.tp, parallel.pp, parallel.zero) != (1, 1, 0):
        raise NotImplementedError(
            f"this engine runs data parallelism only; got parallel.tp={parallel.tp}, "
            f"parallel.pp={parallel.pp}, parallel.zero={parallel.zero}: set tp=1, pp=1, zero=0"
        )
    if world_size != parallel.dp:
        raise ValueError(f"world_size={world_size} but parallel.dp={parallel.dp}: they must be equal")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")


class _SyncClock:
    """When DDP handed the last gradient bucket to the all-reduce: the end of backward compute."""

    def __init__(self) -> None:
        self.last_ready = 0.0


def _timed_allreduce(clock, bucket):
    # Same arithmetic as DDP's built-in reduction (divide by the world size, then sum).
    # No annotations: DDP compares them with dist.GradBucket, and postponed (string)
    # annotations would fail that check.
    clock.last_ready = time.perf_counter()
    return default_hooks.allreduce_hook(None, bucket)


class Engine:
    """One rank's model replica, optimizer and data cursor; `train_step` runs one optimizer step.

    `fault_hook(point, step)`, if set (also assignable later as `engine.fault_hook`), is called
    once per step at each of FAULT_POINTS: before the step, after the last microbatch's
    forward (before the backward that syncs gradients), after that backward, and after the
    optimizer step.
    """

    def __init__(
        self,
        model: ModelConfig,
        data: DataConfig,
        train: TrainConfig,
        parallel: ParallelConfig,
        *,
        rank: int,
        world_size: int,
        device: str | torch.device = "cpu",
        fault_hook: Callable[[str, int], None] | None = None,
    ):
        check_layout(parallel, world_size, rank)
        if train.precision == "fp16":
            raise NotImplementedError(
                "train.precision='fp16' needs a loss scaler, which this engine does not have: "
                "use 'bf16' (same speed, no scaler needed) or 'fp32'"
            )
        if data.seq_len > model.max_seq_len:
            raise ValueError(
                f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}"
            )
        self.device = torch.device(device)
        if train.deterministic:
            # cuBLAS reads this before its first call; without it deterministic mode raises.
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.model_config, self.data_config = model, data
        self.train_config, self.parallel_config = train, parallel
        self.rank, self.world_size = rank, world_size
        self.dp_rank, self.dp_size = rank, parallel.dp
        self.fault_hook = fault_hook
        self.n_micro = microbatches_per_rank(train.global_batch, train.micro_batch, parallel.dp)
        self.data = DataCursor(data, model.vocab_size)
        self.model = build_model(model, seed=train.seed, device=self.device)
        self._clock = _SyncClock()
        self._ddp = self._wrap_ddp() if world_size > 1 else None
        self.optimizer = build_optimizer(self.model, train)
        self.next_step = 0

    def _wrap_ddp(self) -> DistributedDataParallel:
        if not dist.is_initialized():
            raise RuntimeError(
                f"world_size={self.world_size} needs torch.distributed.init_process_group first"
            )
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ValueError(
                f"engine rank {self.rank}/{self.world_size} does not match the default process "
                f"group's rank {dist.get_rank()}/{dist.get_world_size()}"
            )
        # find_unused_parameters=True fixes the gradient bucket layout for the engine's life.
        # By default DDP reduces everything in one bucket in its first iteration, then rebuilds
        # its buckets in the order gradients became ready. A ring all-reduce over more than two
        # ranks sums an element in an order that depends on its offset in the bucket, so a fresh
        # DDP built after a restore (one bucket again) rounds differently from the run it
        # resumes. Measured with torch 2.13, gloo, 4 ranks, tiny model: 3 resumed steps left
        # 93 of 136 state tensors different from the uninterrupted run; with the flag, none.
        # (2 ranks are immune: a + b == b + a.) With find_unused_parameters DDP never rebuilds,
        # so every engine, fresh or not, reduces with the same layout at every step. The price
        # is one autograd-graph traversal per step, small next to the backward, and a warning
        # DDP logs once per process that no unused parameters were found: expected here.
        # forward_sync_buffers=False: the only buffers (RoPE tables) are constants.
        ddp = DistributedDataParallel(
            self.model,
            bucket_cap_mb=self.parallel_config.ddp_bucket_mb,
            forward_sync_buffers=False,
            find_unused_parameters=True,
        )
        ddp.register_comm_hook(self._clock, _timed_allreduce)
        return ddp

    def _fault(self, point: str, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, step)

    def _autocast(self) -> contextlib.AbstractContextManager:
        # bf16 compute with fp32 weights: the optimizer always updates fp32 master weights.
        if self.train_config.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self) -> StepResult:
        """One optimizer step over the global batch of step `next_step`; collective on DDP."""
        step, tc = self.next_step, self.train_config
        started = time.perf_counter()
        self._fault("before_step", step)
        # Dropout draws from the global generator; reseeding it per step from (seed, step,
        # dp_rank) means a resumed run needs no RNG state from the checkpoint.
        torch.manual_seed(derive_seed(tc.seed, "dropout", step, self.dp_rank))
        batches = self.data.microbatches(step, tc.global_batch, tc.micro_batch, self.dp_rank, self.dp_size)
        local_tokens = sum(batch.n_tokens for batch in batches)
        global_tokens = self._sum_over_ranks(local_tokens)
        compute_started = time.perf_counter()
        loss_sum = self._forward_backward(step, batches, global_tokens)
        compute_s = self._compute_seconds(compute_started)
        self._fault("after_backward", step)
        grad_norm = clip_grad_norm(self.model.parameters(), tc.grad_clip)
        lr = lr_at(step, tc)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.next_step = step + 1
        self._fault("after_optimizer_step", step)
        if self._ddp is not None:
            loss_sum, _ = all_reduce_token_loss(loss_sum, local_tokens)
        return StepResult(
            step=step, loss=loss_sum / global_tokens, tokens=global_tokens, grad_norm=grad_norm,
            lr=lr, compute_s=compute_s, step_s=time.perf_counter() - started,
        )

    def _sum_over_ranks(self, count: int) -> int:
        if self._ddp is None:
            return count
        total = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total)

    def _forward_backward(self, step: int, batches: list[Batch], global_tokens: int) -> float:
        """Accumulate the gradient of (sum of all token losses of the step) / global_tokens.

        DDP averages gradients over the dp ranks, so each rank scales its loss sums by
        dp_size / global_tokens; gradients are synced only in the last microbatch's backward.
        Returns this rank's summed token loss.
        """
        scale = self.dp_size / global_tokens
        module = self._ddp if self._ddp is not None else self.model
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, batch in enumerate(batches):
            last = k == len(batches) - 1
            no_sync = self._ddp.no_sync() if self._ddp is not None and not last else contextlib.nullcontext()
            with no_sync:
                with self._autocast():
                    logits = module(batch.input_ids.to(self.device))
                part, _ = token_loss_sum(logits, batch.labels.to(self.device))
                if last:
                    self._fault("after_forward", step)
                (part * scale).backward()
            loss_sum += part.detach()
        return float(loss_sum)

    def _compute_seconds(self, compute_started: float) -> float:
        # On DDP the last bucket's hand-off marks the end of backward compute; what follows
        # inside backward() is waiting for the all-reduce, i.e. for the slowest rank.
        if self._ddp is not None and self._clock.last_ready > compute_started:
            return self._clock.last_ready - compute_started
        return time.perf_counter() - compute_started

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The whole training state as named CPU tensors (copies, safe to write in the background).

        "model/<param>" for every parameter and "optim/<param>/<field>" for every optimizer
        state field (AdamW: exp_avg, exp_avg_sq, step; SGD: momentum_buffer). Parameter names
        are those of trainer.model. Before the first step the optimizer has no state yet.
        """
        tensors: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            tensors[f"model/{name}"] = _snapshot(param)
            for field, value in self.optimizer.state.get(param, {}).items():
                tensors[f"optim/{name}/{field}"] = _snapshot(value)
        return tensors

    def state_slices(self) -> list[TensorSlice]:
        """This rank's training state as slices of logical tensors (trainer.state_slices), CPU copies.

        On DDP every rank holds every tensor whole: replica = dp rank, replicas = dp degree.
        """
        return [whole(name, t, self.dp_rank, self.dp_size) for name, t in self.state_tensors().items()]

    def wanted_slices(self) -> list[TensorSlice]:
        """The slices `load_slices` needs, without data, also before the optimizer has state."""
        wanted = []
        for name, param in self.model.named_parameters():
            shape = tuple(param.shape)
            wanted.append(_geometry(f"model/{name}", param.dtype, shape, self.dp_rank, self.dp_size))
            for field, fshape in _optimizer_fields(self.train_config, shape):
                wanted.append(_geometry(f"optim/{name}/{field}", torch.float32, fshape, self.dp_rank, self.dp_size))
        return wanted

    def load_slices(self, slices: list[TensorSlice], meta: dict) -> None:
        """Restore from the slices `wanted_slices` named, each with its data (read from any layout)."""
        self.load_state({piece.name: piece.tensor for piece in slices}, meta)

    def state_meta(self) -> dict:
        """The JSON-able rest of the state: the cursor (next_step), seeds and the layout."""
        tc, pc = self.train_config, self.parallel_config
        return {
            "format": STATE_FORMAT,
            "next_step": self.next_step,
            "data_seed": self.data_config.seed,
            "train_seed": tc.seed,
            "global_batch": tc.global_batch,
            "optimizer": tc.optimizer,
            # The schedule is a pure function of the step; its next value is informational.
            "lr": lr_at(self.next_step, tc),
            "layout": {"dp": pc.dp, "tp": pc.tp, "pp": pc.pp, "zero": pc.zero,
                       "micro_batch": tc.micro_batch, "world_size": self.world_size},
        }

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore a state saved by `state_tensors` + `state_meta`, possibly from another dp degree.

        Every rank calls it with the same checkpoint, between steps. The tensors are copied,
        never aliased. Raises ValueError if the checkpoint does not fit this engine.
        """
        self._check_meta(meta)
        params = dict(self.model.named_parameters())
        optim_fields = _split_state(tensors, params)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(tensors[f"model/{name}"])
                param.grad = None
        # Through load_state_dict so torch places each field (AdamW keeps `step` on the CPU).
        index = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                index[param] = len(index)
        state_dict = self.optimizer.state_dict()
        state_dict["state"] = {
            index[params[name]]: {field: value.clone() for field, value in fields.items()}
            for name, fields in optim_fields.items()
        }
        self.optimizer.load_state_dict(state_dict)
        self.next_step = int(meta["next_step"])

    def _check_meta(self, meta: dict) -> None:
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"state format {meta.get('format')!r} is not {STATE_FORMAT!r}")
        expected = {"data_seed": self.data_config.seed, "global_batch": self.train_config.global_batch,
                    "optimizer": self.train_config.optimizer}
        for key, value in expected.items():
            if meta.get(key) != value:
                raise ValueError(
                    f"checkpoint has {key}={meta.get(key)!r} but this run has {value!r}: "
                    "resuming would change the training trajectory"
                )
        if int(meta.get("next_step", -1)) < 0:
            raise ValueError(f"checkpoint next_step={meta.get('next_step')!r} is not a step number")


def _geometry(name: str, dtype: torch.dtype, shape: tuple, replica: int, replicas: int) -> TensorSlice:
    return TensorSlice(name=name, dtype=dtype, global_shape=shape, offsets=(0,) * len(shape),
                       lengths=shape, replica=replica, replicas=replicas)


def _optimizer_fields(train: TrainConfig, shape: tuple) -> list[tuple[str, tuple]]:
    """Optimizer state fields per parameter, as torch's optimizers create them on the first step."""
    if train.optimizer == "adamw":
        return [("exp_avg", shape), ("exp_avg_sq", shape), ("step", ())]
    return [("momentum_buffer", shape)] if train.betas[0] != 0 else []


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _split_state(tensors: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> dict:
    """Check names and shapes; return {param name: {optimizer field: tensor}}."""
    missing = sorted(f"model/{name}" for name in params if f"model/{name}" not in tensors)
    unexpected, optim_fields = [], {}
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "model" and rest in params:
            if value.shape != params[rest].shape:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}, the model {tuple(params[rest].shape)}"
                )
            continue
        name, _, field = rest.rpartition("/")
        if kind == "optim" and name in params:
            optim_fields.setdefault(name, {})[field] = value
        else:
            unexpected.append(key)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}"
        )
    if optim_fields and len(optim_fields) != len(params):
        raise ValueError(f"optimizer state covers {len(optim_fields)} of {len(params)} parameters")
    return optim_fields
