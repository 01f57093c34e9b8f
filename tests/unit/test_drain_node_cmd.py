"""`undying drain-node`'s wait and its input checks, without Ray (the real drain on a local Ray
cluster: tests/ray/test_drain_node_cmd.py)."""

from __future__ import annotations

import sys

from orchestrator.cli.drain_node import POLL_S, RANK_CLASSES, wait_for_ranks_to_leave
from orchestrator.cli.main import main


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_the_wait_ends_as_soon_as_no_rank_is_left():
    clock, counts = FakeClock(), iter([2, 2, 1, 0, 5])
    left = wait_for_ranks_to_leave("n", 1100.0, lambda node: next(counts), clock=clock.time, sleep=clock.sleep)
    assert left == 0 and clock.now == 1000.0 + 3 * POLL_S  # three polls found ranks, the fourth none


def test_the_wait_ends_at_the_deadline_with_the_ranks_still_there():
    clock = FakeClock()
    left = wait_for_ranks_to_leave("n", 1002.2, lambda node: 3, clock=clock.time, sleep=clock.sleep)
    assert left == 3 and clock.now == 1002.2  # the last sleep is cut to the deadline, not a whole poll


def test_a_node_without_ranks_is_not_waited_for():
    clock = FakeClock()
    assert wait_for_ranks_to_leave("n", 1100.0, lambda node: 0, clock=clock.time, sleep=clock.sleep) == 0
    assert clock.now == 1000.0


def test_a_negative_wait_is_refused_before_ray_is_reached(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of Ray would raise
    assert main(["drain-node", "--wait", "-5"]) == 2
    assert "--wait must be 0 or more seconds, not -5" in capsys.readouterr().err


def test_the_rank_class_waited_for_is_the_one_ray_records_for_a_rank():
    # Ray's actor table names an actor by its class's qualified name.
    from orchestrator.rank.actor import RankActor

    assert RankActor.__qualname__ in RANK_CLASSES
