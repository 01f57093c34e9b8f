"""Preemption and node drain end to end, on the local Ray clusters.

SIGTERM to `undying run` at a random moment of training (what Kubernetes sends a pod it
evicts): the job checkpoints at the next step boundary and exits 75 within the grace; the
rerun redoes no step and ends with the failure-free run's model, bit for bit. The same
through `ray job stop` against a `ray start --head` cluster. A node drained through Ray's
drain API (by `undying drain-node`, a worker pod's preStop hook; the autoscaler and
spot-termination handlers drain the same way): its ranks move to warm spares at a checkpointed
step boundary, or dp shrinks past them, before the node leaves, no work lost.

Heavy: each runs two or three real jobs (about a minute apiece on two cores).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from tests.ray.jobs import ROOT, finish_job, start_job, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.heavy]
EXIT_PREEMPTED = 75
GRACE_S = 25.0  # elastic.preemption_grace_s's default
RAY = str(Path(sys.executable).parent / "ray")
UNDYING = str(Path(sys.executable).parent / "undying")


def _model(checkpoint_dir: str, step: int) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(Catalog(Storage(f"file://{checkpoint_dir}")), step)
    return {name: t for name, t in tensors.items() if name.startswith("model/")}


def _assert_same_model(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys() and ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), f"{name} differs from the failure-free run"


def _stop_step(text: str, signal_name: str) -> tuple[int, int]:
    """(step reached when the signal was seen, step committed) from the controller's log."""
    reached = int(re.search(rf"STOPPING: {signal_name} at step (\d+)", text).group(1))
    committed = int(re.search(r"checkpoint step (\d+) committed, every rank stopped", text).group(1))
    return reached, committed


def _rerun_redoes_nothing(result: dict, committed: int, reference: dict, checkpoint_dir: Path) -> None:
    assert result["status"] == "succeeded" and result["final_step"] == 40
    assert result["redone_steps"] == 0 and min(p["step"] for p in result["losses"]) == committed
    assert result["final_loss"] == reference["final_loss"]
    _assert_same_model(_model(str(checkpoint_dir), 40), _model(reference["checkpoint_dir"], 40))


def test_sigterm_checkpoints_exits_75_and_the_rerun_redoes_nothing(ray_cluster, tmp_path, reference):
    seed = random.randrange(10**6)
    delay = random.Random(seed).uniform(0.0, 6.0)  # a random moment of training, so a random step
    # Rank 0 sleeps 3x its step time (the numbers do not change), so that training lasts ~10 s.
    proc, report, log = start_job(ray_cluster, tmp_path, "sigterm",
                                  ["chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 4}]"])
    wait_for(log, "-> RUNNING", proc)
    time.sleep(delay)
    assert proc.poll() is None, f"the job ended before the signal (seed {seed})"
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code = proc.wait(timeout=GRACE_S + 30)
    took = time.monotonic() - sent
    text = log.read_text()
    assert code == EXIT_PREEMPTED, f"seed {seed}: exit {code}\n{text[-4000:]}"
    assert took < GRACE_S, f"seed {seed}: exited {took:.1f} s after SIGTERM"
    reached, committed = _stop_step(text, "SIGTERM")
    assert committed >= reached
    first = json.loads(report.read_text())
    assert first["status"] == "preempted" and first["final_step"] == committed
    assert max(p["step"] for p in first["losses"]) + 1 == committed  # nothing trained past the commit
    again = finish_job(*start_job(ray_cluster, tmp_path, "sigterm", ["chaos.faults=[]"]))
    _rerun_redoes_nothing(again, committed, reference, tmp_path / "ckpt" / "sigterm")
    print(f"seed {seed}: SIGTERM {delay:.2f} s into training at step {reached}, step {committed} committed, "
          f"exit 75 after {took:.2f} s")


def _job(address: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [RAY, "job", *args[:1], "--address", address, *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _wait_job_log(address: str, job_id: str, text: str, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        logs = _job(address, "logs", job_id).stdout
        if text in logs or time.monotonic() > deadline:
            return logs
        time.sleep(0.5)


def test_ray_job_stop_preempts_the_job_and_the_rerun_resumes(ray_head, tmp_path):
    dashboard = os.environ["UNDYING_TEST_DASHBOARD"]
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(int(GRACE_S) + 15)}})
    sets = ["train.steps=100", "checkpoint.every_steps=50", f"checkpoint.url=file://{tmp_path}/ckpt"]
    # The first run's rank 0 sleeps 14x its step time, so its stop takes longer than Ray's default 3 s
    # wait: only a RAY_JOB_STOP_WAIT_TIME_S that reached the job supervisor lets it exit on its own.
    slow = "chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 15}]"

    def submit(job_id: str, report: Path, wait: bool) -> subprocess.CompletedProcess:
        entry = ["undying", "run", "examples/tiny.yaml", "--report", str(report)]
        for item in [*sets, "chaos.faults=[]" if wait else slow]:
            entry += ["--set", item]
        return _job(dashboard, "submit", "--submission-id", job_id, "--working-dir", str(ROOT),
                    "--runtime-env-json", runtime_env, *([] if wait else ["--no-wait"]), "--", *entry)

    first = tmp_path / "first.json"
    assert submit("preempt-1", first, wait=False).returncode == 0
    logs = _wait_job_log(dashboard, "preempt-1", "-> RUNNING")
    assert "-> RUNNING" in logs, logs[-3000:]
    time.sleep(1.0)
    stopped_at = time.monotonic()
    assert _job(dashboard, "stop", "preempt-1").returncode == 0
    logs = _wait_job_log(dashboard, "preempt-1", "undying: job preempted", timeout_s=GRACE_S + 20)
    took = time.monotonic() - stopped_at
    assert "undying: job preempted" in logs, logs[-4000:]
    assert 3.0 < took < GRACE_S
    reached, committed = _stop_step(logs, "SIGTERM")
    result = json.loads(first.read_text())
    assert result["status"] == "preempted" and result["final_step"] == committed >= reached
    again = tmp_path / "again.json"
    proc = submit("preempt-2", again, wait=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"restored step {committed}" in proc.stdout
    result = json.loads(again.read_text())
    assert result["status"] == "succeeded" and result["redone_steps"] == 0
    assert min(p["step"] for p in result["losses"]) == committed
    print(f"ray job stop at step {reached}: step {committed} committed, the driver out after {took:.2f} s")


def _node_of_bundle(address: str, bundle: int) -> str:
    """The node id (hex) of bundle `bundle` of the cluster's one live placement group."""
    probe = (f"import json, ray; ray.init(address={address!r}, logging_level='ERROR'); "
             "print(json.dumps([t['bundles_to_node_id'] for t in ray.util.placement_group_table().values() "
             "if t['state'] == 'CREATED']))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    [table] = json.loads(out.stdout.strip().splitlines()[-1])
    return table[str(bundle)]


def _drain_bundle_node_once_its_ranks_moved(local_cluster, proc, log, deadline_s: int) -> str:
    """Once the job runs, drain the node of bundle 1 as a worker pod's preStop hook does (`undying
    drain-node`: Ray's drain with a deadline, as a spot reclaim notice gives, then a wait for the
    node's ranks to leave); once it returns, no rank is left there and the node is taken away, as
    Kubernetes ends the pod. Returns its id."""
    wait_for(log, "-> RUNNING", proc)
    node_id = _node_of_bundle(local_cluster.address, 1)
    [node] = [n for n in local_cluster.nodes if n.node_id == node_id]
    drain = subprocess.run([UNDYING, "drain-node", "--address", local_cluster.address, "--node-id", node_id,
                            "--wait", str(deadline_s), "--reason", "spot reclaim"], capture_output=True, text=True,
                           timeout=deadline_s + 60)
    assert drain.returncode == 0, drain.stdout + drain.stderr + log.read_text()[-4000:]
    assert f"no rank on node {node_id[:12]}" in drain.stdout
    wait_for(log, "no work lost", proc, timeout_s=30)  # logged once the moved ranks' seats are settled
    # Ray has the node's ranks dead; their processes are on their way out.
    deadline = time.monotonic() + 30
    while local_cluster.rank_pids(node) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert local_cluster.rank_pids(node) == []
    local_cluster.cluster.remove_node(node, allow_graceful=False)
    local_cluster.nodes.remove(node)
    return node_id


def test_a_drained_node_s_ranks_move_to_spares_before_it_leaves(local_cluster, tmp_path, reference):
    # 4 ranks fill two nodes (PACK), the 2 spares the third. The node of rank 1 is drained with a
    # deadline, as a spot reclaim notice does; once its ranks have moved it is taken away.
    try:
        proc, report, log = start_job(local_cluster.address, tmp_path, "drain", ["elastic.spares=2",
                                                                                 "chaos.faults=[]"])
        node_id = _drain_bundle_node_once_its_ranks_moved(local_cluster, proc, log, deadline_s=120)
        result = finish_job(proc, report, log)
        text = log.read_text()
        moved = re.search(rf"node {node_id[:12]} draining \(rank\(s\) \[([\d, ]+)\], deadline in \d+ s\)", text)
        assert moved and 1 in [int(r) for r in moved.group(1).split(",")], text[-4000:]
        assert "taken over by warm spares" in text and result["failures"] == []
        assert result["goodput"]["badput_s"].get("lost_work", 0.0) == 0.0
        assert [w["dp"] for w in result["world_history"]] == [4, 4]
        assert result["redone_steps"] == 0 and result["final_loss"] == reference["final_loss"]
    finally:
        local_cluster.restore(3)


def test_a_drained_node_s_ranks_with_no_seat_elsewhere_shrink_at_once_and_grow_back_once_it_has_gone(
        local_cluster, tmp_path):
    # No spare: the 4 ranks fill two nodes (PACK), the third node is empty and outside the job's
    # placement group. Ray starts no actor in a draining node's seats, so the drained ranks are not
    # replaced and dp shrinks to 2 at once; once the node has gone, Ray re-places its seats on the
    # third node, spares warm up there and dp grows back. Rank 0 sleeps (numbers unchanged) so
    # commits remain after the seats come back.
    try:
        proc, report, log = start_job(local_cluster.address, tmp_path, "drain0", [
            "train.steps=80", "elastic.min_dp=2",
            "chaos.faults=[{kind: slow_rank, rank: 0, at_step: 0, factor: 4}]"])
        _drain_bundle_node_once_its_ranks_moved(local_cluster, proc, log, deadline_s=300)
        result = finish_job(proc, report, log)
        text = log.read_text()
        moved = re.search(r"rank\(s\) \[([\d, ]+)\] not replaced: their seats are on a draining node.*"
                          r"shrinking dp 4 -> 2", text)
        assert moved and 1 in [int(r) for r in moved.group(1).split(",")], text[-4000:]
        assert "replaced by new actors" not in text and "no replacement for" not in text
        assert [w["dp"] for w in result["world_history"]] == [4, 2, 4], text[-4000:]
        assert result["failures"] == [] and result["goodput"]["badput_s"].get("lost_work", 0.0) == 0.0
    finally:
        local_cluster.restore(3)
