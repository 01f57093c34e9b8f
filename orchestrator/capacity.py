"""Can the cluster ever hold this job? Checked by the CLI before any actor exists (exit 2) and
again by the worker group before it reserves a placement group."""

from __future__ import annotations

from orchestrator.problems import Problem


def slots(spec) -> int:
    """Actors the job keeps: one per rank plus the warm spares."""
    return spec.world_size + spec.elastic.spares


def capacity_problems(spec, cluster: dict[str, float]) -> list[Problem]:
    """Resources the cluster (`ray.cluster_resources()`) can never provide for `spec` (pure)."""
    res, world, spares = spec.resources, spec.world_size, spec.elastic.spares
    wanted = {"CPU": ("resources.cpus_per_rank", res.cpus_per_rank),
              "GPU": ("resources.gpus_per_rank", res.gpus_per_rank)}
    wanted.update({key: (f"resources.custom.{key}", amount) for key, amount in res.custom.items()})
    who = f"{world} ranks (dp*tp*pp)" + (f" + {spares} spares" if spares else "")
    problems = []
    for key, (field, per_rank) in wanted.items():
        need, have = per_rank * slots(spec), cluster.get(key, 0.0)
        if per_rank > 0 and have < need:
            problems.append(Problem(
                field, f"{who} x {per_rank:g} {key} = {need:g} {key}, but the cluster has {have:g}; lower "
                       f"{field.split('.')[-1]}{', elastic.spares' if spares else ''} or parallel degrees, "
                       "or add nodes"))
    return problems
