"""Enumerate every parallel layout of a workload on N devices, reject the impossible ones with
their reason, and rank the rest by predicted step time.

Pure: no processes, no devices (except measuring the CPU row, done by the caller). The spec
is read for the workload (model, data, train) and for the schedule and DDP bucket size it
asks for; its own `parallel` degrees are not used, since every layout is tried (each a
`Layout` of plain numbers, not a new JobSpec).

A candidate is (dp, tp, pp, zero, micro_batch) with tp <= n_heads, pp <= n_layers and
micro_batch a divisor of global_batch / dp, and with ZeRO 2/3 each HSDP replica count
(dp_replicate: replicas of at least two ranks). The first failing check is the reason: what the
engine refuses (trainer.layout_checks.layout_refusals, the one function the engine and the
job spec call too, so a ranked layout is never one they refuse), dp * tp * pp = N, ZeRO
needing dp > 1 (zero > 0 at dp = 1 runs as zero 0: one row is enough), then memory. pp need
not divide n_layers: the engine cuts the layers by FLOPs (trainer.stages.split_layers) and
the cost model prices that split, its most loaded stage bounding memory and time.
Memory tries recomputation none, then selective, then block, and keeps the first that fits:
less recomputation is always faster, so the kept one is the layout's best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainer.costmodel.hardware import Hardware
from trainer.costmodel.layout import RECOMPUTE_CHOICES, Layout, Workload
from trainer.costmodel.memory import Ledgers, ledgers, runtime_reserve_bytes
from trainer.costmodel.time import Prediction, predict
from trainer.layout_checks import layout_refusals
from trainer.stages import default_virtual_stages

GiB = 1 << 30


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    prediction: Prediction


@dataclass(frozen=True)
class Rejection:
    """`key` names the group the reason belongs to (equal for layouts rejected for the same
    reason, e.g. "tp=3: 32 heads not divisible by 3"); `reason` is this layout's own text."""

    layout: Layout
    key: str
    reason: str
    memory: Ledgers | None = None


@dataclass
class Plan:
    hardware: Hardware
    n_gpus: int
    valid: list[Candidate] = field(default_factory=list)  # fastest first
    rejected: list[Rejection] = field(default_factory=list)

    def rejected_groups(self) -> list[tuple[str, list[Rejection]]]:
        """Rejections grouped by key, in first-seen order; within an out-of-memory group the
        layout closest to fitting comes first."""
        groups: dict[str, list[Rejection]] = {}
        for rejection in self.rejected:
            groups.setdefault(rejection.key, []).append(rejection)
        for members in groups.values():
            members.sort(key=lambda r: r.memory.total if r.memory else 0)
        return list(groups.items())


def capacity_bytes(hw: Hardware, layout: Layout) -> int:
    """Memory the caching allocator of one rank can use: the device less the runtime reserve;
    on a CPU the host's RAM is shared by the ranks placed on it."""
    sharing = min(layout.world, hw.devices_per_node) if hw.kind == "cpu" else 1
    return hw.hbm_bytes // sharing - runtime_reserve_bytes(layout, hw.kind)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _structural_reason(work: Workload, lay: Layout, n_gpus: int) -> tuple[str, str] | None:
    """(key, reason) of the first reason `lay` cannot run on `n_gpus` devices, or None.

    The engine's refusals come first (trainer.layout_checks.layout_refusals, the rules the
    engine and the job spec apply), then the device count, then the planner's own pruning.
    """
    refused = layout_refusals(work.model, lay, work.seq_len, work.global_batch, lay.micro_batch, work.compile,
                              work.eval_len)
    if refused:
        return refused[0].key, str(refused[0])
    if lay.world != n_gpus:
        verb = "exceeds" if lay.tp * lay.pp > n_gpus else "does not divide"
        key = f"tp*pp={lay.tp * lay.pp} {verb} {n_gpus} devices"
        return key, key
    if lay.zero and lay.dp == 1:
        key = "zero>0 with dp=1: nothing to shard (same as zero=0)"
        return key, key
    return None


def _oom_reason(lay: Layout, memory: Ledgers, capacity: int) -> tuple[str, str]:
    key = f"dp={lay.dp} tp={lay.tp} pp={lay.pp} zero={lay.zero}: out of memory"
    reason = (f"needs {memory.total / GiB:.1f} GiB > {capacity / GiB:.1f} GiB usable "
              f"(micro_batch={lay.micro_batch}, recompute={lay.recompute}): state {memory.state / GiB:.1f} "
              f"+ activation {memory.activation / GiB:.1f} + collective {memory.collective / GiB:.1f} "
              f"+ transient {memory.transient / GiB:.1f} GiB")
    return key, reason


def _fit(work: Workload, lay: Layout, hw: Hardware, recompute: Sequence[str]) -> Candidate | Rejection:
    """The candidate with the least recomputation that fits, or the last one's OOM rejection; a
    recomputation the engine refuses with this layout (zero-bubble's) is not tried."""
    capacity, too_big, refused_first = capacity_bytes(hw, lay), None, None
    for choice in recompute:
        trial = replace(lay, recompute=choice)
        refused = layout_refusals(work.model, trial, work.seq_len, work.global_batch, trial.micro_batch, work.compile,
                                  work.eval_len)
        if refused:
            refused_first = refused_first or (trial, refused[0])
            continue
        memory = ledgers(work, trial, hw.kind)
        if memory.total <= capacity:
            return Candidate(trial, predict(work, trial, hw))
        too_big = (trial, memory)
    if too_big is None:  # every choice refused
        trial, refusal = refused_first
        return Rejection(trial, refusal.key, str(refusal))
    trial, memory = too_big
    key, reason = _oom_reason(trial, memory, capacity)
    return Rejection(trial, key, reason, memory)


def enumerate_layouts(work: Workload, n_gpus: int, schedule: str, ddp_bucket_mb: float = 25.0,
                      sequence_parallel: bool = True, virtual_stages: int | None = None) -> list[Layout]:
    """Every (dp, tp, pp, zero, micro_batch) the planner considers (module docstring), with the
    spec's schedule, chunks per pipeline rank and sequence parallelism."""
    out = []
    v = virtual_stages or default_virtual_stages(schedule)
    for tp in range(1, min(n_gpus, work.model.n_heads) + 1):
        for pp in range(1, min(n_gpus, work.model.n_layers) + 1):
            dp = max(1, n_gpus // (tp * pp))
            per_replica = work.global_batch // dp if work.global_batch % dp == 0 else 1
            for zero in range(4):
                for replicas in _replica_counts(dp, zero):
                    for mb in _divisors(per_replica):
                        out.append(Layout(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb, schedule=schedule,
                                          virtual_stages=v if pp > 1 else 1, ddp_bucket_mb=ddp_bucket_mb,
                                          dp_replicate=replicas, sequence_parallel=sequence_parallel))
    return out


def _replica_counts(dp: int, zero: int) -> list[int]:
    """1 (shard over all of dp), and under ZeRO 2/3 every HSDP split of dp into replicas of at
    least two ranks: fewer ranks to gather from and reduce over, more state per rank."""
    if zero < 2:
        return [1]
    return [r for r in _divisors(dp) if r == 1 or dp // r >= 2]


def plan(spec_like: Any, hw: Hardware, n_gpus: int,
         recompute: Sequence[str] = RECOMPUTE_CHOICES) -> Plan:
    """Rank every layout of `spec_like`'s workload on `n_gpus` devices of `hw`.

    `spec_like` has the job spec's `model`, `data`, `train` sections and optionally
    `parallel` (for the schedule and DDP bucket size; 1f1b and 25 MB otherwise).
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus}: plan for at least one device")
    work = Workload.from_spec(spec_like)
    par = getattr(spec_like, "parallel", None)
    schedule = par.schedule if par is not None else "1f1b"
    bucket_mb = par.ddp_bucket_mb if par is not None else 25.0
    sequence_parallel = par.sequence_parallel if par is not None else True
    virtual = par.virtual_stages if par is not None else None
    result = Plan(hardware=hw, n_gpus=n_gpus)
    for lay in enumerate_layouts(work, n_gpus, schedule, bucket_mb, sequence_parallel, virtual):
        problem = _structural_reason(work, lay, n_gpus)
        if problem is not None:
            result.rejected.append(Rejection(lay, *problem))
            continue
        outcome = _fit(work, lay, hw, recompute)
        (result.valid if isinstance(outcome, Candidate) else result.rejected).append(outcome)
    # Equal bounds (compute-bound layouts) go to less network traffic, then less memory:
    # both are headroom for what the bound leaves out (imperfect overlap, fragmentation).
    result.valid.sort(key=lambda c: (c.prediction.step_s, c.prediction.comm_s, c.prediction.memory.total,
                                     c.layout.label()))
    return result


def out_of_memory(spec: Any, hw: Hardware) -> str | None:
    """Why the spec's own layout does not fit one device of `hw` by the cost model (the planner's
    words, with the ledgers), or None when it fits. The driver asks before it places any rank."""
    work, lay = Workload.from_spec(spec), Layout.from_spec(spec)
    memory, capacity = ledgers(work, lay, hw.kind), capacity_bytes(hw, lay)
    return None if memory.total <= capacity else _oom_reason(lay, memory, capacity)[1]

