"""Which warm spare takes which lost rank: a TP group never ends up split over two nodes (pure)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.cluster.placement import assign_spares, split_tp_groups, tp_runs_by_node


def test_a_lost_rank_takes_a_spare_beside_its_group_when_its_node_has_one():
    live = {0: "a", 2: "b", 3: "b"}
    choice = assign_spares([1], 2, live, [(4, "c"), (5, "c"), (6, "a")])
    assert choice.seats == {1: 6} and choice.moved == [] and choice.left == []


def test_a_group_whose_node_has_no_spare_moves_whole_onto_another_node_s_spares():
    # Eight-GPU nodes, tp = 2 here for brevity: the spare group sits on its own node.
    live = {0: "a", 2: "b", 3: "b"}
    choice = assign_spares([1], 2, live, [(4, "c"), (5, "c")])
    assert choice.seats == {1: 4, 0: 5} and choice.moved == [0] and choice.left == []


def test_without_room_for_the_whole_group_the_lost_ranks_are_left_for_their_own_seats():
    live = {0: "a", 1: "a", 3: "a"}  # tp = 4: rank 2 lost; node a has one spare, node c two
    choice = assign_spares([2], 4, live, [(4, "c"), (5, "c")])
    assert choice.seats == {} and choice.left == [2]
    choice = assign_spares([1, 2], 4, {0: "a", 3: "a"}, [(4, "a"), (5, "c")])
    assert choice.seats == {1: 4} and choice.left == [2]  # what the node has, the rest cold beside it


def test_a_group_lost_whole_takes_one_node_s_spares_else_any_rather_than_wait_for_a_seat():
    # Its seats were on the lost node: there is no seat beside it to start in, so rather than wait
    # (and shrink, or fail) it takes what there is, and the recovery names the split.
    ready = [(4, "c"), (5, "d"), (6, "d")]
    assert assign_spares([0, 1], 2, {}, ready).seats == {0: 5, 1: 6}
    assert assign_spares([0, 1], 2, {}, ready[:2]).seats == {0: 4, 1: 5}
    assert assign_spares([0, 1, 2, 3], 4, {}, [(4, "c"), (5, "d"), (6, "d")]).left == [3]


def test_groups_lost_whole_are_served_first():
    # Group {0, 1} lost rank 1 only and can start it cold beside rank 0; group {2, 3} has no other way.
    choice = assign_spares([1, 2, 3], 2, {0: "a"}, [(4, "c"), (5, "c")])
    assert choice.seats == {2: 4, 3: 5} and choice.left == [1]


def test_with_tp_1_any_spare_will_do():
    choice = assign_spares([3, 1], 1, {0: "a", 2: "b"}, [(4, "c"), (5, "d")])
    assert choice.seats == {1: 4, 3: 5} and choice.left == []


@settings(max_examples=300, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), groups=st.integers(1, 4), data=st.data())
def test_every_group_stays_on_one_node_and_no_spare_is_given_twice(tp, groups, data):
    nodes = ["a", "b", "c"]
    world = tp * groups
    group_node = [data.draw(st.sampled_from(nodes)) for _ in range(groups)]  # placed whole, one node each
    lost = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1)))
    live = {r: group_node[r // tp] for r in range(world) if r not in lost}
    ready = [(world + i, node) for i, node in enumerate(data.draw(st.lists(st.sampled_from(nodes), max_size=8)))]
    choice = assign_spares(lost, tp, live, ready)

    assert sorted(choice.seats.values()) == sorted(set(choice.seats.values()))  # each spare once
    assert sorted([*choice.seats.keys() - set(choice.moved), *choice.left]) == lost  # every lost rank accounted for
    node = dict(ready)
    playing = {**live, **{r: node[s] for r, s in choice.seats.items()}}
    unused = Counter(n for seat, n in ready if seat not in choice.seats.values())
    for start in range(0, world, tp):
        members = [r for r in range(start, start + tp) if r in playing]
        if len({playing[r] for r in members}) > 1:  # only a group lost whole, and only when no node had room
            assert not any(r in live for r in members) and max(unused.values(), default=0) < tp, (start, playing)
    assert all(r in live for r in choice.moved)


def test_a_shrink_fills_its_gaps_a_tp_group_s_worth_from_one_node_at_a_time():
    node = {0: "a", 3: "b", 4: "a", 6: "b", 9: "c"}
    assert tp_runs_by_node([0, 3, 4, 6, 9], 2, node.get) == [0, 4, 3, 6, 9]
    assert tp_runs_by_node([0, 3, 4, 6, 9], 1, node.get) == [0, 4, 3, 6, 9]


def test_split_groups_are_named_and_an_unknown_node_splits_nothing():
    node = {0: "a", 1: "a", 2: "a", 3: "b", 4: "c"}
    assert split_tp_groups(2, 6, node.get) == [[2, 3]]  # rank 5 has no node (no actor yet)
