"""Can the cluster ever hold this job, and how many warm spares does it keep? Checked by the CLI
before any actor exists (exit 2) and again by the worker group before it reserves a placement group.

Spares (`elastic.spares`): an explicit number is a requirement, refused here with the field named
when the cluster cannot hold it beside the ranks. `auto` (the default) is a wish: one spare TP
group (tp seats) when the cluster has room for it, none otherwise, so the default never makes a
job that fits without a spare fail or wait (`resolve_spares`, one printed sentence either way).
"""

from __future__ import annotations

from orchestrator.cluster.placement import group_resources, rank_resources, tp_groups_that_fit
from orchestrator.spec.problems import Problem


def explicit_spares(spec) -> int:
    """The spares the spec requires: its number, or 0 for an unresolved `auto`."""
    return 0 if spec.elastic.spares == "auto" else spec.elastic.spares


def slots(spec) -> int:
    """Actors the job may keep: one per rank plus the spares it asks for (`auto`: one TP group)."""
    wanted = spec.parallel.tp if spec.elastic.spares == "auto" else spec.elastic.spares
    return spec.world_size + wanted


def capacity_problems(spec, cluster: dict[str, float]) -> list[Problem]:
    """Resources the cluster (`ray.cluster_resources()`) can never provide for `spec` (pure).

    Ranks that cannot fit name the per-rank field; ranks that fit without their explicit spares
    but not with them name `elastic.spares`."""
    res, world, spares = spec.resources, spec.world_size, explicit_spares(spec)
    wanted = {"CPU": ("resources.cpus_per_rank", res.cpus_per_rank),
              "GPU": ("resources.gpus_per_rank", res.gpus_per_rank)}
    wanted.update({key: (f"resources.custom.{key}", amount) for key, amount in res.custom.items()})
    problems = []
    for key, (field, per_rank) in wanted.items():
        have = cluster.get(key, 0.0)
        if per_rank <= 0 or have >= per_rank * (world + spares):
            continue
        if have >= per_rank * world:
            room = int(have / per_rank + 1e-6) - world
            problems.append(Problem(
                "elastic.spares", f"{world} ranks + {spares} spares x {per_rank:g} {key} = "
                                  f"{per_rank * (world + spares):g} {key}, but the cluster has {have:g}, room for "
                                  f"{room} spare(s); lower elastic.spares, or set it to auto (a spare when one fits)"))
            continue
        problems.append(Problem(
            field, f"{world} ranks (dp*tp*pp) x {per_rank:g} {key} = {per_rank * world:g} {key}, but the cluster "
                   f"has {have:g}; lower {field.split('.')[-1]} or parallel degrees, or add nodes"))
    return problems


def node_problems(spec, nodes: list[dict[str, float]]) -> list[Problem]:
    """TP groups that no node of the cluster (each alive node's total resources) can hold (pure).

    Every TP group is one placement-group bundle, and Ray never splits a bundle across nodes,
    so a group that fits in the cluster's total but on no single node would wait forever.
    Explicit spares come as whole TP-group bundles when their number is a multiple of tp
    (orchestrator.cluster.placement), and must fit the nodes the same way."""
    tp, groups = spec.parallel.tp, spec.world_size // spec.parallel.tp
    need = group_resources(spec.resources, tp)
    fit = sum(tp_groups_that_fit(node, need) for node in nodes)
    spares = explicit_spares(spec)
    if fit >= groups:
        if spares and spares % tp == 0 and fit < groups + spares // tp:
            return [Problem("elastic.spares", f"{spares} spares come as {spares // tp} TP group(s) of {tp}, each on "
                                              f"one node; the cluster's nodes hold {fit} group(s), {groups} of them "
                                              "for the ranks; lower elastic.spares, or set it to auto")]
        return []
    biggest = max(nodes, key=lambda node: tp_groups_that_fit(node, need), default={})
    offered = ", ".join(f"{biggest.get(key, 0.0):g} {key}" for key in need) or "nothing"
    what = f"a TP group of {tp} ranks" if tp > 1 else "a rank"
    field = "parallel.tp" if tp > 1 else "resources.cpus_per_rank"
    return [Problem(field, f"{what} must sit on one node and needs "
                           f"{', '.join(f'{v:g} {k}' for k, v in need.items())}; the cluster's nodes hold "
                           f"{fit} such group(s) of the {groups} needed (largest node offers {offered}); lower "
                           f"{'tp or ' if tp > 1 else ''}the per-rank resources, or add bigger nodes")]


def resolve_spares(spec, free: dict[str, float], nodes: list[dict[str, float]]) -> tuple[int, str | None]:
    """How many warm spares the job keeps, and for `auto` the sentence that says why (pure).

    `free`: the cluster's resources not in use now (`ray.available_resources()`); `nodes`: each
    alive node's totals. `auto` asks for one TP group of spares (tp seats: any one rank's loss,
    or a whole TP group's, is taken over on one node) and gets it when the nodes can hold one
    more TP-group bundle beside the ranks' and the free resources cover ranks and spares alike;
    else 0, so a job that fits without a spare never waits for one. An explicit number is
    returned as given (capacity_problems / node_problems refuse one that cannot fit)."""
    if spec.elastic.spares != "auto":
        return spec.elastic.spares, None
    tp, groups = spec.parallel.tp, spec.world_size // spec.parallel.tp
    seat = rank_resources(spec.resources)
    cost = ", ".join(f"{amount * tp:g} {key}" for key, amount in seat.items() if amount > 0)
    unit = f"one spare TP group of {tp}" if tp > 1 else "one spare"
    short = [key for key, amount in seat.items()
             if amount > 0 and free.get(key, 0.0) + 1e-6 < amount * (groups + 1) * tp]
    if short:
        return 0, (f"elastic.spares auto: no spare, the cluster's free {', '.join(short)} cannot hold {unit} "
                   f"({cost}) beside the {spec.world_size} ranks; recovery starts new actors instead")
    if sum(tp_groups_that_fit(node, group_resources(spec.resources, tp)) for node in nodes) < groups + 1:
        return 0, (f"elastic.spares auto: no spare, no node has room for {unit} ({cost}) beside the ranks' "
                   f"{groups} bundle(s); recovery starts new actors instead")
    return tp, (f"elastic.spares auto: {unit} kept warm ({cost} and one more actor's memory), so a lost rank "
                "is taken over in well under a second; elastic.spares: 0 for none")


_TABLE_ROWS = {"a100-80g": "a100", "a100": None}  # Ray's bare A100 says nothing of its memory


def device_memory_note(spec, cluster: dict[str, float]) -> str | None:
    """A warning when the cost model finds the spec's layout too big for the cluster's GPUs (Ray's
    `accelerator_type:<NAME>` resources, for the GPUs the cost model's table knows; the smallest
    when there are several), naming the planner that proposes layouts which fit; None otherwise.
    A warning, not a refusal: the model's peak is checked on CPUs, not yet on a GPU."""
    from trainer.costmodel.hardware import GPUS
    from trainer.costmodel.planner import out_of_memory

    if not spec.resources.gpus_per_rank:
        return None
    kinds = {key.split(":", 1)[1].lower() for key in cluster if key.startswith("accelerator_type:")}
    # Ray's names (H100, H200, A100-80G, A100-40G...) as the table's rows; a variant the table lacks
    # (the 40 GB A100) gets no guess rather than another card's memory.
    known = sorted((_TABLE_ROWS.get(k, k) for k in kinds if _TABLE_ROWS.get(k, k) in GPUS),
                   key=lambda k: GPUS[k].hbm_bytes)
    why = out_of_memory(spec, GPUS[known[0]]) if known else None
    if why is None:
        return None
    return (f"the cost model finds this layout too big for one {GPUS[known[0]].name}: {why}; `undying plan "
            f"JOB.yaml --gpus {spec.world_size} --gpu {known[0]}` lists layouts that fit")


def cpu_ranks_note(spec, cluster: dict[str, float]) -> str | None:
    """A warning when the ranks ask for no GPU (`resources.gpus_per_rank: 0`, the default) on a cluster
    that has some, or are placed by a custom `accelerator_type:` resource: they would train on CPUs
    with gloo, a hundred times slower, and nothing else would say so. A warning, not a refusal: a
    CPU job may run on a GPU cluster on purpose (a smoke test beside a training job)."""
    if spec.resources.gpus_per_rank:
        return None
    gpus = cluster.get("GPU", 0.0)
    asked = sorted(name for name in spec.resources.custom if name.startswith("accelerator_type:"))
    if not gpus and not asked:
        return None
    where = f"the cluster has {gpus:g} GPU(s)" if gpus else f"the ranks ask for {asked[0]}"
    return (f"{where}, but resources.gpus_per_rank is 0: every rank trains on CPUs (gloo); set "
            "resources.gpus_per_rank: 1 to train on the GPUs")


def host_memory_note(spec, nodes: list[dict[str, float]]) -> str | None:
    """For a job on CPUs: a warning when the cost model finds the ranks that one node would hold
    too big for its memory (Ray's `memory` resource of the node, what it lets tasks use), naming
    the node that holds the most ranks (pack fills a node first) and what to change; None
    otherwise. A warning, not a refusal, like `device_memory_note`: the host's kernel, not Ray,
    ends a rank that exceeds it, and other jobs' use is unknown here."""
    from trainer.costmodel.layout import Layout, Workload
    from trainer.costmodel.memory import ledgers, runtime_reserve_bytes

    if spec.resources.gpus_per_rank or not nodes:
        return None
    layout = Layout.from_spec(spec)
    per_rank = ledgers(Workload.from_spec(spec), layout, "cpu").total + runtime_reserve_bytes(layout, "cpu")
    group = group_resources(spec.resources, spec.parallel.tp)
    loads = [(ranks * per_rank / memory, ranks, memory) for node in nodes  # (need / memory, ranks, memory)
             if (ranks := min(spec.world_size, spec.parallel.tp * tp_groups_that_fit(node, group)))
             and (memory := node.get("memory", 0.0))]
    load, ranks, memory = max(loads, default=(0.0, 0, 0.0))
    if load <= 1.0:
        return None
    shard = ", shard the state (parallel.zero: 3)" if spec.parallel.zero < 3 else ""
    return (f"the cost model finds {ranks} rank(s) of this layout on one node need about "
            f"{ranks * per_rank / 2**30:.1f} GiB ({per_rank / 2**30:.2f} GiB each: weights, gradients, optimizer "
            f"state, activations and the process) where Ray gives its tasks {memory / 2**30:.1f} GiB, so Ray's "
            "memory monitor or the kernel would end ranks mid-step: put fewer ranks on a node (a larger "
            f"resources.cpus_per_rank, more nodes){shard}, or train a smaller model")
