"""The release after a crashed machine (orchestrator.controller.recovery.Recovery.release): the nodes the
probe finds gone have their ranks dropped at once, not waited on and killed as hung, and a late report
of such a node is ignored; a signal during the wait ends it at once. A node-level fake of the worker
group; pure, no Ray."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from monitor.metrics import JobMetrics
from orchestrator.cluster.worker_group import RankOutcome
from orchestrator.controller.policies import ScalingPolicy
from orchestrator.controller.recovery import Recovery
from orchestrator.spec.job_spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
RELEASE_S = 1.0


class TwoNodes:
    """Ranks 0 and 1 on node "up", 2 and 3 on node "down": their `train` calls never return, as
    the calls of a machine that went away without a word (no reset, no watchdog report)."""

    def __init__(self):
        self.actors = {rank: f"actor{rank}" for rank in range(4)}
        self.node = {0: "up", 1: "up", 2: "down", 3: "down"}
        self.lost_nodes: set[str] = set()
        self.pending = set(self.actors)
        self.killed: list[int] = []
        self.interrupted = lambda: False  # the controller's "is the job ending?" (RayWorkerGroup's)

    def nodes_in_use(self) -> set[str]:
        return {self.node[rank] for rank in self.actors} - self.lost_nodes

    def forget_node(self, node: str) -> list[int]:
        self.lost_nodes.add(node)
        ranks = [rank for rank in sorted(self.actors) if self.node[rank] == node]
        for rank in ranks:
            self.kill(rank)
        return ranks

    def kill(self, rank: int) -> None:
        self.killed.append(rank)
        self.actors.pop(rank, None)
        self.pending.discard(rank)

    def running(self) -> list[int]:
        return sorted(self.pending)

    def wait_any(self, timeout_s: float) -> list[RankOutcome]:
        out = [RankOutcome(rank, "aborted", {"error": "aborted"}) for rank in sorted(self.pending)
               if self.node[rank] == "up"]
        self.pending -= {o.rank for o in out}
        if not out:
            time.sleep(timeout_s)
        return out

    def leave_all(self, ranks: list[int], timeout_s: float) -> list[int]:
        return []


def _release(probe) -> tuple[SimpleNamespace, TwoNodes, dict, SimpleNamespace, list[str]]:
    spec = load_spec(str(ROOT / "examples/demo.yaml"), ["checkpoint.url=memory://release"])
    policy = ScalingPolicy.for_spec(spec)
    workers, lines, errors = TwoNodes(), [], {0: "RuntimeError: Connection reset by peer"}
    probed = []
    recovery = Recovery(spec, workers, policy, lines.append, release_timeout_s=RELEASE_S, poll_s=0.01,
                        metrics=JobMetrics(spec.name), probe=lambda nodes: probed.append(set(nodes)) or probe(nodes))
    intake = SimpleNamespace(take_lost_nodes=lambda: [], drain=lambda store: [], nodes_handled=set())
    released = recovery.release(SimpleNamespace(request_abort=lambda: None), 4, errors, intake)
    return released, workers, errors, intake, [*lines, *map(str, probed)]


def test_a_node_found_gone_has_its_ranks_dropped_at_once_and_its_late_report_ignored():
    started = time.monotonic()
    released, workers, errors, intake, lines = _release(lambda nodes: ["down"] if "down" in nodes else [])
    assert time.monotonic() - started < RELEASE_S  # nothing waited on the gone node's calls
    assert released.crashed == {"down": [2, 3]} and released.stuck == [] and released.lost == [2, 3]
    assert errors[2] == errors[3] == "node down lost" and errors[0].startswith("RuntimeError")
    assert intake.nodes_handled == {"down"} and workers.lost_nodes == {"down"}
    assert "{'down', 'up'}" in lines or "{'up', 'down'}" in lines  # every node the job holds was probed
    assert any(line.startswith("node down lost (its raylet is gone): rank(s) [2, 3]") for line in lines)


def test_without_the_probe_finding_it_the_same_ranks_are_waited_on_then_killed_as_hung():
    released, workers, errors, intake, _ = _release(lambda nodes: [])
    assert released.crashed == {} and released.stuck == [2, 3] and released.lost == [2, 3]
    assert intake.nodes_handled == set() and workers.lost_nodes == set()


def test_a_signal_during_the_release_wait_gives_it_up_at_once():
    # Twice the median step can outlast a pod's grace: the wait asks, each poll, whether the job ends.
    import pytest

    from orchestrator.cluster.interruptible import Interrupted

    spec = load_spec(str(ROOT / "examples/demo.yaml"), ["checkpoint.url=memory://release"])
    policy = ScalingPolicy.for_spec(spec)
    workers = TwoNodes()
    recovery = Recovery(spec, workers, policy, lambda line: None, release_timeout_s=60.0, poll_s=0.01,
                        metrics=JobMetrics(spec.name), probe=lambda nodes: [])
    signalled_at = time.monotonic() + 0.2
    workers.interrupted = lambda: time.monotonic() >= signalled_at
    with pytest.raises(Interrupted):
        recovery.wait_out()  # ranks 2 and 3 never return
    assert time.monotonic() - signalled_at < 1.0 and workers.killed == []  # the teardown kills them
