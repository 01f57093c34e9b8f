"""Data parallelism over the dp group, by ZeRO stage (Rajbhandari et al. 2020, arXiv:1910.02054).

    zero 0  DDP: replicated parameters, gradients all-reduced in buckets during backward
    zero 1  DDP + ZeroRedundancyOptimizer: the optimizer state of each parameter lives on one
            dp rank, which updates the parameter and broadcasts it
    zero 2  FSDP2 `fully_shard(reshard_after_forward=False)`: parameters, gradients and optimizer
            state sharded; a block's parameters stay gathered from its forward to its backward
    zero 3  FSDP2 `fully_shard(reshard_after_forward=True)`: parameters regathered for backward;
            one unit per block, so the next block's all-gather is prefetched

Protocol: the engine calls exactly one wrapper, last in the order TP -> recompute -> data
parallelism, on every rank (collective: DDP broadcasts, FSDP creates its groups):
`wrap_ddp` (zero 0/1; after `localize_dtensor_params` when tp > 1) or `apply_fsdp` (zero 2/3),
then builds the optimizer on the wrapped parameters (`build_zero1_optimizer` for zero 1).
Per microbatch it enters `gradient_sync(...)`: DDP communicates only in the last microbatch's
backward; FSDP2 reduce-scatters every microbatch, so gradients stay sharded while they accumulate.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainer.config import TrainConfig
from trainer.device_clock import DeviceClock
from trainer.optim import param_groups

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


class SyncClock:
    """A step's compute time: from `start_compute` to when DDP handed the last gradient bucket to
    the all-reduce (the end of backward compute: what follows inside backward() is waiting for the
    slowest rank), or to `compute_seconds` without DDP. Marks come from `device`
    (trainer.device_clock: CUDA events on a GPU, whose launches return before the work is done).

    `in_flight`, when set (the engine sets it while a chaos fault hook is armed), is called after
    each bucket's all-reduce is launched: the fault point "in_allreduce" (trainer.engine)."""

    def __init__(self, device: DeviceClock | None = None) -> None:
        self.device = device or DeviceClock()
        self.started = self.last_ready = None
        self.in_flight: Callable[[], None] | None = None

    def start_compute(self) -> None:
        self.started, self.last_ready = self.device.mark(), None

    def compute_seconds(self, ddp: bool) -> float:
        end = self.last_ready if ddp and self.last_ready is not None else self.device.mark()
        return self.device.seconds(self.started, end)


def _timed_allreduce(clock, bucket):
    # Same arithmetic as DDP's built-in reduction (divide by the world size, then sum): the
    # bucket's all-reduce is launched exactly as before, and the fault point runs only after it,
    # touching no tensor, so an unfired point leaves every gradient bit-identical.
    # No annotations: DDP compares them with dist.GradBucket, and postponed (string)
    # annotations would fail that check.
    clock.last_ready = clock.device.mark()
    future = default_hooks.allreduce_hook(clock.group, bucket)
    if clock.in_flight is not None:
        clock.in_flight()
    return future


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for the buffer broadcast before each forward: `forward_sync_buffers` from torch
    2.13 on (which deprecates the older name), `broadcast_buffers` before it: a GPU image brings the
    torch built for its driver, which may be older than the CPU set-up's."""
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}


def wrap_ddp(module: nn.Module, dp_group, bucket_mb: float, clock: SyncClock) -> DistributedDataParallel:
    """DDP over `dp_group` with a fixed bucket layout and the timing comm hook (collective:
    every rank of `dp_group` calls it, as DDP's construction requires)."""
    # No buffer broadcast before each forward: the only buffers (RoPE tables) are constants. Every
    # parameter is used in every step, so DDP needs no search for unused ones
    # (find_unused_parameters would cost an autograd-graph traversal per step).
    ddp = DistributedDataParallel(module, process_group=dp_group, bucket_cap_mb=bucket_mb, **_no_forward_buffer_sync())
    fix_bucket_layout(ddp)
    clock.group = dp_group
    ddp.register_comm_hook(clock, _timed_allreduce)
    return ddp


def fix_bucket_layout(ddp: DistributedDataParallel) -> None:
    """Give DDP its final gradient buckets now, so that every engine, fresh or resumed,
    reduces with the same layout at every step. Collective over DDP's group; called once,
    right after construction, before the comm hook is registered.

    By default DDP reduces everything in one bucket in its first iteration, then rebuilds its
    buckets in the order gradients became ready. A ring all-reduce over more than two ranks
    sums an element in an order that depends on its offset in the bucket, so a fresh DDP
    built after a restore (one bucket again) would round differently from the run it resumes
    (torch 2.13, gloo, 4 ranks, tiny model: 3 resumed steps left 93 of 136 state tensors
    different; 2 ranks are immune, a + b == b + a). Here DDP records the gradients' order
    from one backward of a graph that makes every parameter's gradient ready in reverse
    registration order (the order a forward-ordered model's backward produces them, DDP's
    own assumption for its first buckets), with zero gradients, and rebuilds its buckets
    from it at once; DDP rebuilds only once, so the layout holds for the engine's life.
    """
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    ddp.reducer.prepare_for_backward([])
    total = torch.zeros((), device=params[0].device)
    for param in params:  # autograd runs the most recently recorded node first: the last parameter's
        total = total + param.reshape(-1)[:1].sum() * 0
    total.backward()
    ddp._has_rebuilt_buckets = ddp.reducer._rebuild_buckets()
    assert ddp._has_rebuilt_buckets, "DDP did not take the fixed bucket layout"
    for param in params:
        param.grad = None


def localize_dtensor_params(root: nn.Module) -> dict[str, tuple]:
    """Make DDP (which only knows plain tensors) work on a tensor-parallel module.

    Each DTensor parameter is replaced, under the same name, by a plain Parameter holding its
    local shard, so DDP buckets, ZeroRedundancyOptimizer and the optimizer see local tensors.
    A forward pre-hook on `root` puts a DTensor view of each local shard (`from_local`, whose
    backward hands the local gradient to the plain parameter) in the owning module's
    instance dict, where attribute lookup finds it before the registered parameter; so the
    TP forward, the tied head (`tok_emb.weight` read outside the embedding) and activation
    recomputation in backward all use this step's views. (torch's own DDP + TP transform
    re-creates the parameters at every forward and leaves the module without them.)

    Returns {parameter name: (mesh, placements, global shape)} of the replaced parameters.
    """
    specs, owners = {}, []
    seen: dict[int, nn.Parameter] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        if not isinstance(param, DTensor):
            continue
        module_name, _, attr = name.rpartition(".")
        owner = root.get_submodule(module_name)
        if id(param) not in seen:
            local = nn.Parameter(param.to_local().detach().clone(), requires_grad=param.requires_grad)
            seen[id(param)] = local
            specs[name] = (param.device_mesh, tuple(param.placements), tuple(param.shape), param.stride())
        local = seen[id(param)]
        owner._parameters[attr] = local
        owners.append((owner, attr, local))
    by_local = {id(local): spec for local, spec in zip(seen.values(), specs.values(), strict=True)}

    def inject(_module, _args):
        views: dict[int, DTensor] = {}
        for owner, attr, local in owners:
            if id(local) not in views:
                mesh, placements, shape, stride = by_local[id(local)]
                views[id(local)] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                      shape=shape, stride=stride)
            owner.__dict__[attr] = views[id(local)]

    if owners:
        root.register_forward_pre_hook(inject)
    return {name: spec[:3] for name, spec in specs.items()}


def apply_fsdp(module: nn.Module, dp_mesh, zero: int, precision: str) -> nn.Module:
    """FSDP2 over `dp_mesh`: one unit per block, then the rest (embeddings, norm, head) at the root."""
    policy = MixedPrecisionPolicy()
    if precision in LOW_PRECISION:
        # Low-precision compute copies gathered from the fp32 shards (the master weights);
        # gradients reduced and kept in fp32.
        policy = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)
    reshard = zero == 3
    blocks = getattr(module, "blocks", None)
    units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or [])
    for block in units:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return module


def build_zero1_optimizer(model: nn.Module, train: TrainConfig, dp_group) -> ZeroRedundancyOptimizer:
    """AdamW / SGD with its state partitioned over the dp group (each rank steps its own part).

    The partition (sorted-greedy by size) is a pure function of the parameter list, so a
    fresh engine owns the same parameters as the one whose checkpoint it loads.
    """
    groups = param_groups(model, train.weight_decay)
    if train.optimizer == "adamw":
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=dp_group,
                                       lr=train.lr, betas=train.betas)
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.SGD, process_group=dp_group,
                                   lr=train.lr, momentum=train.betas[0])


def gradient_sync(ddp: DistributedDataParallel | None, fsdp_root: nn.Module | None, last: bool):
    """Context for one microbatch of a step without pipeline parallelism.

    DDP (ZeRO 0/1) all-reduces only in the last microbatch's backward: its gradients are
    whole on every rank anyway, so accumulating them locally costs no memory.
    FSDP2 (ZeRO 2/3) reduce-scatters every microbatch's gradients into the sharded gradient,
    which accumulates them: a rank never holds more than one unit's unsharded gradients, as
    ZeRO-2 is defined. Skipping the sync would make FSDP2 keep every parameter's unsharded
    fp32 gradient until the last microbatch (G per rank instead of G/D). The price is the
    reduce-scatter once per microbatch instead of once per step (trainer.costmodel.time).
    Under HSDP the all-reduce across replicas of the gradient shards still runs once, in the
    last microbatch (FSDP2 keeps the partial sums in between).
    """
    if ddp is not None and not last:
        return ddp.no_sync()
    if fsdp_root is not None:
        fsdp_root.set_requires_gradient_sync(True)
        fsdp_root.set_requires_all_reduce(last)
    return contextlib.nullcontext()


def reshard_gathered(module: nn.Module) -> None:
    """Give back the parameters FSDP2 gathered for a forward that no backward follows (an evaluation):
    with `reshard_after_forward` off (zero 2) they stay whole until the next backward, a whole model
    per rank through the checkpoint staging after an evaluation. Nothing to do without FSDP."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
