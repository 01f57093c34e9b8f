"""Who keeps the copy of each rank's memory snapshot: a buddy on another node.

The rule (docs/design.md, "Two levels"): every rank's snapshot lives in two processes, its
own and its buddy's, and the buddy runs on another node whenever the job spans more than
one, so that losing any one node never loses both copies of any shard. The nodes are taken
in the order their first rank appears; the k-th rank of node i sends its copy to the
(k mod n)-th rank of node i+1 (cyclically), n being that node's rank count, so every node
both sends and receives and the copies spread over the next node's ranks. On one node the
buddy is the next rank (a copy that survives a process, not the node), and a job of one
rank has none.

Pure: the controller calls `choose_buddies` with each rank's node at the start of every
generation (a spare or a shrink moves ranks).
"""

from __future__ import annotations

from collections.abc import Sequence


def choose_buddies(nodes: Sequence[str | None]) -> list[int | None]:
    """`nodes[r]`: the node of rank r (None: unknown, taken as a node of its own). Returns the buddy
    rank of every rank (None for a job of one rank)."""
    world = len(nodes)
    if world < 2:
        return [None] * world
    groups: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node if node is not None else f"unknown-{rank}", []).append(rank)
    order = list(groups.values())
    if len(order) == 1:
        return [(rank + 1) % world for rank in range(world)]
    buddies: list[int | None] = [None] * world
    for index, ranks in enumerate(order):
        target = order[(index + 1) % len(order)]
        for k, rank in enumerate(ranks):
            buddies[rank] = target[k % len(target)]
    return buddies


def survives_any_node_loss(nodes: Sequence[str | None], buddies: Sequence[int | None]) -> bool:
    """Whether losing any one node leaves a copy of every rank's shard (the rule the tests hold)."""
    return all(b is not None and nodes[b] != nodes[r] for r, b in enumerate(buddies))
