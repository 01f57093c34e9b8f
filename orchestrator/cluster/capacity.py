"""Can the cluster ever hold this job? Checked by the CLI before any actor exists (exit 2) and
again by the worker group before it reserves a placement group."""

from __future__ import annotations

from orchestrator.cluster.placement import group_resources, tp_groups_that_fit
from orchestrator.spec.problems import Problem


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


def node_problems(spec, nodes: list[dict[str, float]]) -> list[Problem]:
    """TP groups that no node of the cluster (each alive node's total resources) can hold (pure).

    Every TP group is one placement-group bundle, and Ray never splits a bundle across nodes,
    so a group that fits in the cluster's total but on no single node would wait forever."""
    tp, groups = spec.parallel.tp, spec.world_size // spec.parallel.tp
    need = group_resources(spec.resources, tp)
    fit = sum(tp_groups_that_fit(node, need) for node in nodes)
    if fit >= groups:
        return []
    biggest = max(nodes, key=lambda node: tp_groups_that_fit(node, need), default={})
    offered = ", ".join(f"{biggest.get(key, 0.0):g} {key}" for key in need) or "nothing"
    what = f"a TP group of {tp} ranks" if tp > 1 else "a rank"
    field = "parallel.tp" if tp > 1 else "resources.cpus_per_rank"
    return [Problem(field, f"{what} must sit on one node and needs "
                           f"{', '.join(f'{v:g} {k}' for k, v in need.items())}; the cluster's nodes hold "
                           f"{fit} such group(s) of the {groups} needed (largest node offers {offered}); lower "
                           f"{'tp or ' if tp > 1 else ''}the per-rank resources, or add bigger nodes")]
