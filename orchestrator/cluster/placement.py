"""How a job's ranks map onto Ray placement-group bundles (pure; no Ray calls).

A tensor-parallel group exchanges activations in every layer, so it must share a node; data-
and pipeline-parallel traffic is once per step or per microbatch and can cross nodes. Ray
keeps each bundle of a placement group on one node, so the plan gives every TP group one
bundle of `tp` seats (one seat per rank): no placement Ray may choose can split a TP group.
The bundles themselves are then packed onto few nodes (`resources.placement: pack`, the
default: intra-node links for the DP and PP collectives too, and a lost node takes whole DP
replicas with it) or spread over as many nodes as possible (`spread`: DP replicas and PP
stages on different machines, so one machine's loss or slowness touches fewer of them).

Seats are numbered: seat r < world_size is rank r's at placement time (ranks r..r+tp-1 with
r % tp == 0 are one TP group, the topology's TP-fastest order); warm spares follow. Spares
come as whole TP groups when `elastic.spares` is a multiple of tp (a lost node's group can be
replaced on one node), else one seat per bundle.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


@dataclass(frozen=True)
class PlacementPlan:
    bundles: list[dict[str, float]]  # Ray resources of each bundle
    seat_bundle: list[int]  # seat -> index of the bundle it sits in
    strategy: str  # Ray's strategy name

    @property
    def n_seats(self) -> int:
        return len(self.seat_bundle)


def rank_resources(resources) -> dict[str, float]:
    """What one rank asks Ray for (`resources` is the spec's ResourcesConfig)."""
    wanted = {"CPU": resources.cpus_per_rank, **resources.custom}
    if resources.gpus_per_rank:
        wanted["GPU"] = resources.gpus_per_rank
    return wanted


def group_resources(resources, tp: int) -> dict[str, float]:
    """What one TP group's bundle asks Ray for: tp ranks' worth on one node."""
    return {key: amount * tp for key, amount in rank_resources(resources).items()}


def plan_placement(world_size: int, tp: int, spares: int, resources, placement: str) -> PlacementPlan:
    if world_size % tp:
        raise ValueError(f"world size {world_size} is not a multiple of tp = {tp}")
    spare_group = tp if spares and spares % tp == 0 else 1
    bundles: list[dict[str, float]] = []
    seat_bundle: list[int] = []
    for size, count in ((tp, world_size // tp), (spare_group, spares // spare_group)):
        for _ in range(count):
            seat_bundle += [len(bundles)] * size
            bundles.append(group_resources(resources, size))
    return PlacementPlan(bundles, seat_bundle, STRATEGIES[placement])


def tp_groups_that_fit(node_resources: dict[str, float], group: dict[str, float]) -> int:
    """How many TP-group bundles one node (its total Ray resources) can ever hold."""
    # The epsilon absorbs float sums such as 3 x 0.1 CPU; Ray itself counts in 1e-4 units.
    fits = [int(node_resources.get(key, 0.0) / amount + 1e-6) for key, amount in group.items() if amount > 0]
    return min(fits) if fits else 0


def tp_locality(spec, world_size: int, node_of) -> str:
    """Words on where the TP groups landed: one node each, and over how many nodes.

    Each TP group is one placement-group bundle, so at placement it always shares a node;
    a group refilled from spares on other nodes after a failure would not, and this says
    so by naming it (TP then runs at the inter-node bandwidth). `node_of(rank)` is the
    worker group's."""
    tp = spec.parallel.tp
    groups = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    nodes = {node_of(g[0]) for g in groups}
    unit = "TP group" if tp > 1 else "rank"
    spread = f"{len(groups)} {unit}(s) over {len(nodes)} node(s) ({spec.resources.placement})"
    split = split_tp_groups(tp, world_size, node_of)
    if tp == 1:
        return f"; {spread}"
    if not split:
        return f"; each TP group on one node, {spread}"
    return f"; WARNING: TP group(s) {split} span nodes, {spread}"


def split_tp_groups(tp: int, world_size: int, node_of) -> list[list[int]]:
    """The TP groups whose ranks run on more than one node (`node_of(rank)`, the worker group's;
    None, a rank without an actor or not yet heard from, counts as no node)."""
    groups = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    return [g for g in groups if len({node_of(r) for r in g} - {None}) > 1]


@dataclass(frozen=True)
class SeatChoice:
    """Where `RayWorkerGroup.replace_cold` puts each lost rank's new actor (`choose_seats`)."""

    seats: dict[int, int]  # rank -> seat
    waiting: list[int]  # ranks whose seat is on a node Ray starts nothing on now: they wait for it
    stranded: list[int]  # of `waiting`, those on a draining node: theirs comes back only once it has gone


def choose_seats(ranks: list[int], own: dict[int, int], free: list[int], on_lost: set[int],
                 on_draining: set[int]) -> SeatChoice:
    """Seats for new actors of `ranks`: each rank's own seat (`own`: beside its TP group) when
    that is on a live node, else the first `free` seat (holding no rank or spare) on a live node,
    else its own seat all the same (pure: the worker group reads the seats' nodes from Ray).

    Seats on a lost node (`on_lost`) come back when the GCS declares the node dead and Ray
    re-places their bundle where there is room: an actor there waits for that. Seats on a node
    being drained (`on_draining`) stay where they are, and Ray starts no new actor on a draining
    node, until the node has gone: such a rank is `stranded`, and the caller may rather shrink
    than wait (Recovery.replace)."""
    usable = [seat for seat in free if seat not in on_lost and seat not in on_draining]
    seats, waiting = {}, []
    for rank in ranks:
        mine = own.get(rank)
        if mine is not None and mine not in on_lost and mine not in on_draining:
            seats[rank] = mine
        elif usable:
            seats[rank] = usable.pop(0)
        else:  # a rank without a seat of its own (none in the records) takes the seat of its number
            seats[rank] = rank if mine is None else mine
            waiting.append(rank)
    return SeatChoice(seats, waiting, [rank for rank in waiting if seats[rank] in on_draining])


@dataclass(frozen=True)
class SpareChoice:
    """Which ready spare takes which lost rank (`assign_spares`)."""

    seats: dict[int, int]  # rank -> the seat of the spare that plays it from now on
    moved: list[int]  # live ranks whose TP group moved whole onto spares: they become spares in their seats
    left: list[int]  # ranks no spare was given to (a new actor in their own seat, beside their group, or none)


def assign_spares(ranks: list[int], tp: int, live_node: dict[int, str | None],
                  ready: list[tuple[int, str | None]]) -> SpareChoice:
    """Ready spares for the lost `ranks`, keeping each TP group on one node where it can (pure).

    `live_node`: rank -> node of every rank that keeps its process; `ready`: (seat, node) of the
    live, warm spares in seat order. Per TP group (ranks r // tp), groups lost whole first (they
    have no other way back), then in rank order, the first that applies:
      1. its lost ranks take spares on the node of its live ranks, when that node has enough;
      2. the whole group takes spares on one node and its live ranks are `moved`: they give up
         their ranks and become spares in their own seats (every rank of a new generation rebuilds
         its engine and loads its state, so which process plays a rank costs no start-up; from the
         memory level the moved ranks read their shards from their old processes, over the
         network when the group changed nodes; the spare count stays the same);
      3. a group with live ranks: its lost ranks take what spares its live ranks' node has, and
         the rest are `left` for new actors in their own seats (beside the group): a cold start of
         seconds, rather than a group whose every layer's all-reduce crosses nodes, which slows
         every step of the job until the next membership change;
      4. a group lost whole (its seats were most likely on a lost node: no seat beside it to start
         in): whatever spares there are, the fullest nodes' first. A group left split is named by
         the recovery (split_tp_groups); waiting for a seat instead could shrink dp or fail the job.
    With tp = 1 every group is one rank and any ready spare will do."""
    by_node: dict[str | None, list[int]] = {}
    for seat, node in ready:
        by_node.setdefault(node, []).append(seat)
    seats: dict[int, int] = {}
    moved: list[int] = []
    left: list[int] = []
    starts = sorted({rank - rank % tp for rank in ranks})
    for start in sorted(starts, key=lambda s: any(r not in ranks and r in live_node for r in range(s, s + tp))):
        group = range(start, start + tp)
        lost = [rank for rank in group if rank in ranks]
        live = [rank for rank in group if rank not in ranks and rank in live_node]
        home = by_node.get(live_node[live[0]], []) if live and live_node[live[0]] is not None else []
        whole = [*lost, *live]
        roomy = next((free for free in by_node.values() if len(free) >= len(whole)), [])
        if live and len(home) >= len(lost):
            taking, spares = lost, home
        elif roomy:
            taking, spares = whole, roomy
            moved += live
        elif live:
            taking, spares = lost[:len(home)], home
            left += lost[len(home):]
        else:
            spares = [seat for free in sorted(by_node.values(), key=len, reverse=True) for seat in free]
            taking = lost[:len(spares)]
            left += lost[len(spares):]
        for rank in taking:
            seat = spares.pop(0)
            seats[rank] = seat
            for free in by_node.values():  # a fallback's list is a copy: take the seat from its node's too
                if seat in free:
                    free.remove(seat)
    return SpareChoice(seats, moved, sorted(left))


def tp_runs_by_node(ranks: list[int], tp: int, node_of) -> list[int]:
    """`ranks` reordered so that each run of tp consecutive ones (a TP group once renumbered) shares
    a node where it can: every node's ranks in whole runs of tp first, then the ones left over,
    which are the first dropped when the list is cut short (pure; `node_of(rank)`)."""
    by_node: dict[str | None, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(node_of(rank), []).append(rank)
    runs, leftover = [], []
    for members in by_node.values():
        cut = len(members) - len(members) % tp
        runs += members[:cut]
        leftover += members[cut:]
    return runs + leftover
