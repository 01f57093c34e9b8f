"""The memory level's host-memory bound, checked before any rank starts.

A rank's memory level holds, at most: the staging buffer of the snapshot being taken, its own
two newest snapshots (the complete one and the one being built) and two of its buddy's, and a
third of each while a new one lands (ckpt.held prunes once it is stored). Each is
the rank's share of the checkpointed state: the fp32 weights and the optimizer's moments of its
slices, a replicated slice counted once over its replicas, about `count_params x (4 + optimizer
bytes) / world_size`. So the bound is 7 shares when every node holds as many ranks as the next
(the buddy rule, orchestrator.cluster.buddies, then gives each rank one buddy's copies); a node
smaller than the one before it holds more, which `undying_memory_snapshot_host_bytes` shows.
"""

from __future__ import annotations

from typing import Any

from orchestrator.spec.problems import Problem

SHARES = 7  # staging + two own snapshots + two of a buddy's, + one of each while a new one lands


def snapshot_share_bytes(spec: Any) -> int:
    """Bytes of one rank's snapshot shard, estimated from the spec."""
    from trainer.costmodel.memory import state_bytes_per_param
    from trainer.model import count_params

    weights, _, optimizer = state_bytes_per_param(spec.train.optimizer)
    return count_params(spec.model) * (weights + optimizer) // max(1, spec.parallel.world_size)


def memory_level_problems(spec: Any) -> list[Problem]:
    checkpoint = getattr(spec, "checkpoint", None)
    if checkpoint is None or not checkpoint.memory.enabled or checkpoint.memory.max_host_bytes is None:
        return []
    if spec.model is None or spec.train is None or spec.parallel is None:
        return []  # reported elsewhere
    need = SHARES * snapshot_share_bytes(spec)
    limit = checkpoint.memory.max_host_bytes
    if need <= limit:
        return []
    return [Problem("checkpoint.memory.max_host_bytes",
                    f"the memory level needs about {need / 2**20:.1f} MiB of host memory per rank ({SHARES} x its "
                    f"{need / SHARES / 2**20:.1f} MiB share of the state: staging, two own snapshots and two of a "
                    f"buddy's, and a third of each while a new one lands), over the limit of "
                    f"{limit / 2**20:.1f} MiB; raise the limit, spread the state over more ranks, or set "
                    "checkpoint.memory.enabled: false")]
