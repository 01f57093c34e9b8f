"""Recovery from memory on the local multi-node cluster (head + 3 worker nodes of 2 slots), each run
through `undying chaos`: the failure-free reference first, then the faulty run, then every invariant
check (checkpoints verify, the final model equals the reference, every sample exactly once, goodput
adds up). The job is the 4-rank demo (tests/ray/jobs.py BASE: a storage checkpoint every 10 steps)
with a memory snapshot every 3 steps; a kill at step 25 finds the snapshot of step 24 complete.

Placement packs ranks 0-1 on one node and 2-3 on the next; the buddy rule sends each node's copies
to the other (rank 0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1).
"""

from __future__ import annotations

import pytest

from tests.ray.jobs import assert_every_check_passed, chaos_job

pytestmark = [pytest.mark.ray, pytest.mark.heavy]
NODES = 3
MEMORY = "checkpoint.memory={enabled: true, every_steps: 3}"


def _run(local_cluster, tmp_path, name: str, faults: str, *sets: str):
    try:
        proc, report_path = chaos_job(local_cluster.address, tmp_path, name, [],
                                      [MEMORY, f"chaos.faults={faults}", *sets], timeout=600)
        return assert_every_check_passed(proc, report_path), proc.stdout
    finally:
        local_cluster.restore(NODES)


def test_a_killed_rank_restores_from_memory_reading_nothing_from_storage(local_cluster, tmp_path):
    report, out = _run(local_cluster, tmp_path, "memrank", "[{kind: kill_rank, rank: 1, at_step: 25}]",
                       "elastic.spares=1")
    [failure] = report["failures"]
    assert failure["restore_level"] == "memory" and failure["storage_read_bytes"] == 0, failure
    assert "restored step 24 from memory" in out and "taken over by warm spares" in out, out[-4000:]


def test_a_lost_node_restores_from_the_buddies_copies_on_the_other_node(local_cluster, tmp_path):
    # Ranks 0 and 1 die with their node, and with it the copies of ranks 2 and 3 it held; their own
    # copies survive on ranks 2 and 3, and theirs on the other node: nothing is lost.
    report, out = _run(local_cluster, tmp_path, "memnode", "[{kind: kill_node, rank: 1, at_step: 25}]",
                       "elastic.spares=2")
    [failure] = report["failures"]
    assert failure["kind"] == "kill_node", failure
    assert failure["restore_level"] == "memory" and failure["storage_read_bytes"] == 0, failure
    assert "restored step 24 from memory" in out, out[-4000:]


def test_two_lost_nodes_lose_a_snapshot_and_fall_back_to_storage_loudly(local_cluster, tmp_path):
    # Both nodes of the ranks die at step 25: every shard of step 24 had its two copies there.
    report, out = _run(local_cluster, tmp_path, "memtwo",
                       "[{kind: kill_node, rank: 1, at_step: 25}, {kind: kill_node, rank: 3, at_step: 25}]",
                       "elastic.spares=2", "elastic.replace_timeout_s=2", "elastic.grow=false")
    assert "memory snapshot of step 24 LOST" in out, out[-4000:]
    restored = [f for f in report["failures"] if f["restore_level"] is not None]
    assert restored and restored[-1]["restore_level"] == "storage" and restored[-1]["storage_read_bytes"] > 0
    assert "restored step 20 in" in out


def test_a_shrink_restores_from_memory_into_the_smaller_layout(local_cluster, tmp_path):
    # No replacement in time: dp 4 -> 2, and the snapshot of step 24 is resharded from memory (rank 1's
    # shard from its buddy), as a resharded load from storage would be.
    report, out = _run(local_cluster, tmp_path, "memshrink", "[{kind: kill_rank, rank: 1, at_step: 25}]",
                       "elastic.spares=0", "elastic.replace_timeout_s=0", "elastic.grow=false")
    assert "shrinking dp 4 -> 2" in out and "restored step 24 from memory" in out, out[-4000:]
    [failure] = report["failures"]
    assert failure["restore_level"] == "memory" and failure["storage_read_bytes"] == 0, failure
