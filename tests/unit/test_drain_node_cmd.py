"""`undying drain-node`'s wait and its input checks, without Ray (the real drain on a local Ray
cluster: tests/ray/test_drain_node_cmd.py)."""

from __future__ import annotations

import sys
import time

import pytest

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


@pytest.mark.parametrize("wait", ["-5", "inf", "nan", "7200"])
def test_a_wait_that_is_not_a_number_of_seconds_up_to_an_hour_is_refused_before_ray_is_reached(wait, capsys,
                                                                                              monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of Ray would raise
    assert main(["drain-node", "--wait", wait]) == 2
    assert f"--wait must be a number of seconds from 0 to 3600, not {float(wait):g}" in capsys.readouterr().err


def test_no_ray_to_reach_is_said_in_one_line(capsys, monkeypatch):
    import ray

    def refuse(**kwargs):
        raise ConnectionError("Could not find any running Ray instance")

    monkeypatch.setattr(ray, "init", refuse)
    assert main(["drain-node", "--wait", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("undying drain-node: no Ray cluster at 'auto' (ConnectionError: Could not find") and (
        "Traceback" not in err)


def test_ray_that_never_answers_is_left_behind_at_the_deadline(capsys, monkeypatch):
    # A request Ray leaves hanging must not hold the hook past the pod's grace: the command gives
    # up at its deadline (and the last answer's allowance), leaving the stuck thread behind.
    import orchestrator.cli.drain_node as drain_node

    monkeypatch.setattr(drain_node, "_drain", lambda *args: time.sleep(60))
    monkeypatch.setattr(drain_node, "abandon", lambda code: code)  # not os._exit in a test process
    monkeypatch.setattr(drain_node, "FINISH_S", 0.2)
    started = time.monotonic()
    assert main(["drain-node", "--wait", "0.5"]) == 1
    assert time.monotonic() - started < 5
    assert "Ray did not answer by the drain's deadline" in capsys.readouterr().err


def test_the_rank_class_waited_for_is_the_one_ray_records_for_a_rank():
    # Ray's actor table names an actor by its class's qualified name.
    from orchestrator.rank.actor import RankActor
    from paramserver.actors import ServerActor, WorkerActor

    assert RankActor.__qualname__ in RANK_CLASSES
    # A parameter-server job's actors: the name Ray records for a class made an actor by @ray.remote.
    assert {ServerActor.__ray_metadata__.class_name, WorkerActor.__ray_metadata__.class_name} <= set(RANK_CLASSES)


def test_this_node_is_not_drained_when_it_is_the_head(capsys, monkeypatch):
    """The hook is a worker pod's: run on the head (by mistake, or from a shell there), draining it
    would end the cluster. Named with --node-id, an operator's drain of it goes through to Ray."""
    import types

    import ray

    import orchestrator.cli.drain_node as drain_node

    head = "ab" * 28
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: head))
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": head, "Alive": True,
                                                "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}}])
    asked = []

    def request_drain(node, reason, deadline):
        asked.append(node)
        return False, "refused here"

    monkeypatch.setattr(drain_node, "request_drain", request_drain)
    assert main(["drain-node", "--wait", "5"]) == 2
    err = capsys.readouterr().err
    assert f"this process's node {head[:12]} is the head of the cluster" in err and asked == []
    assert main(["drain-node", "--wait", "5", "--node-id", head]) == 1 and asked == [head]  # on purpose: asked
