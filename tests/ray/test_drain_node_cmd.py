"""`undying drain-node` against the local Ray cluster: the node is drained in Ray's GCS with the
hook's deadline (what the controller reads, orchestrator.cluster.drain), and the command returns
as soon as no rank actor is left there, whatever else still runs on it, or at its deadline with
the rank still there (exit 1). A node id that names no node is refused. The whole path with a
real job: tests/ray/test_preemption.py (heavy)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
UNDYING = str(Path(sys.executable).parent / "undying")


class RankActor:
    """Stands for a rank: the command counts actors by their class's name, as Ray records it."""

    def pid(self) -> int:
        return os.getpid()


class Bystander:
    """Anything else on the node (it is not waited for)."""

    def pid(self) -> int:
        return os.getpid()


def _drain(address: str, node_id: str, wait_s: float) -> subprocess.Popen:
    return subprocess.Popen([UNDYING, "drain-node", "--address", address, "--node-id", node_id, "--wait", str(wait_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_line(proc: subprocess.Popen, text: str) -> None:
    for line in proc.stdout:
        if text in line:
            return
    raise AssertionError(f"the command ended (exit {proc.wait()}) without saying {text!r}: {proc.stderr.read()}")


def test_the_node_is_drained_and_the_command_returns_once_its_ranks_have_gone(local_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = local_cluster.add_node()
    local_cluster.nodes.append(node)
    ray.init(address=local_cluster.address, logging_level="ERROR")
    try:
        on_node = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        rank = ray.remote(num_cpus=0)(RankActor).options(scheduling_strategy=on_node).remote()
        bystander = ray.remote(num_cpus=0)(Bystander).options(scheduling_strategy=on_node).remote()
        ray.get([rank.pid.remote(), bystander.pid.remote()], timeout=120)
        # A rank that never leaves: the command ends at its deadline, saying the rank is lost.
        short = subprocess.run([UNDYING, "drain-node", "--address", local_cluster.address, "--node-id",
                                node.node_id.upper(), "--wait", "8"], capture_output=True, text=True, timeout=120)
        assert short.returncode == 1 and f"1 rank(s) still on node {node.node_id[:12]}" in short.stderr, short
        proc = _drain(local_cluster.address, node.node_id, 120)
        _wait_for_line(proc, f"node {node.node_id[:12]} draining, deadline in ")
        deadline_s = ray._private.state.state.get_draining_nodes()[node.node_id] / 1000 - time.time()
        assert 100 < deadline_s <= 120  # the hook's wait is the drain's deadline
        time.sleep(1.0)
        assert proc.poll() is None, "returned while a rank was still on the node"
        ray.kill(rank, no_restart=True)  # the controller moves the node's ranks off
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert f"no rank on node {node.node_id[:12]}" in out
        bad = subprocess.run([UNDYING, "drain-node", "--address", local_cluster.address, "--node-id", "ab" * 28,
                              "--wait", "1"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and f"--node-id {'ab' * 28} names no live node" in bad.stderr
    finally:
        ray.shutdown()
        local_cluster.cluster.remove_node(node, allow_graceful=False)
        local_cluster.nodes.remove(node)
