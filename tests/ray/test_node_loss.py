"""Losing a whole node on a local multi-node Ray cluster (head + 3 worker nodes of 2 slots).

The `kill_node` fault ends every process Ray runs on the node hosting the target rank at once,
as a machine crash does: no rank is left to report it, and Ray declares the node dead only after
its health checks time out; the controller's probe of its nodes' raylets finds it at once. A
raylet that dies alone (its ranks live on) is reported by the ranks' node watchdogs.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.ray.jobs import finish_job, start_job, wait_for

pytestmark = pytest.mark.ray
NODES = 3


def test_node_loss_is_detected_in_seconds_and_warm_spares_take_over(local_cluster, tmp_path, reference):
    # 4 ranks fill two nodes (PACK), the 2 spares the third; the node of ranks 0 and 1 dies.
    try:
        proc, report, log = start_job(local_cluster.address, tmp_path, "nodespare", [
            "elastic.spares=2", "chaos.faults=[{kind: kill_node, rank: 1, at_step: 25}]"])
        result = finish_job(proc, report, log)
        text = log.read_text()
        assert [f["kind"] for f in result["failures"]] == ["kill_node"], text[-4000:]
        [failure] = result["failures"]
        assert failure["detected_after_s"] < 3.0  # node loss seen within 3 s, not after Ray's 12-15 s health checks
        assert "lost (its raylet is gone): rank(s) [0, 1]" in text  # the probe found it, nobody waited
        assert "killed [" not in text
        assert "taken over by warm spares" in text
        assert [w["dp"] for w in result["world_history"]] == [4, 4]
        assert result["final_loss"] == reference["final_loss"]  # same layout: bit for bit
    finally:
        local_cluster.restore(NODES)


def test_node_loss_without_spares_shrinks_then_grows_when_a_node_joins(local_cluster, tmp_path, reference):
    # No spare and no free slot: dp shrinks 4 -> 2 on the surviving node. When a new node
    # joins, Ray re-places the lost bundles there, spares start in them and dp grows back to
    # 4 at a checkpoint. Rank 0 is slowed (sleeps only) and checkpoints come every 5 steps
    # (the cadence does not change the numbers) so that commits remain by then.
    try:
        proc, report, log = start_job(local_cluster.address, tmp_path, "nodeshrink", [
            "elastic.replace_timeout_s=2", "checkpoint.every_steps=5",
            "chaos.faults=[{kind: kill_node, rank: 3, at_step: 6},"
            " {kind: slow_rank, rank: 0, at_step: 0, factor: 4}]"])
        wait_for(log, "shrinking dp 4 -> 2", proc)
        local_cluster.restore(NODES)
        result = finish_job(proc, report, log)
        text = log.read_text()
        assert "growing dp 2 -> 4" in text, text[-3000:]
        assert [w["dp"] for w in result["world_history"]] == [4, 2, 4]
        assert result["failures"][0]["detected_after_s"] < 3.0
        assert result["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-5)
        for ours, ref in zip(result["losses"], reference["losses"], strict=True):
            assert ours["step"] == ref["step"] and ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    finally:
        local_cluster.restore(NODES)


def test_a_raylet_that_dies_alone_is_reported_by_its_ranks_watchdogs(local_cluster, tmp_path, reference):
    # No spare: ranks 0-3 fill two nodes, the third is free. The raylet of a node with ranks is
    # killed from outside; its rank processes live on and report the loss (orchestrator.rank.actor),
    # the job keeps dp 4 with new actors in the seats Ray re-places on the free node.
    try:
        proc, report, log = start_job(local_cluster.address, tmp_path, "rayletdies", [
            "elastic.spares=0", "chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 3}]"])
        wait_for(log, " committed: ", proc)  # the first commit, whichever step it is
        node = next(n for n in local_cluster.nodes if local_cluster.rank_pids(n))
        ranks_there = local_cluster.rank_pids(node)
        os.kill(node.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        result = finish_job(proc, report, log)
        text = log.read_text()
        [failure] = result["failures"]
        assert failure["kind"] == "node_lost" and "reported by rank" in failure["message"], text[-4000:]
        assert "lost (reported): rank(s)" in text
        assert [w["dp"] for w in result["world_history"]] == [4, 4]
        assert result["final_loss"] == reference["final_loss"]
        assert not [pid for pid in ranks_there if os.path.exists(f"/proc/{pid}")]  # they exited on their own
    finally:
        local_cluster.restore(NODES)
