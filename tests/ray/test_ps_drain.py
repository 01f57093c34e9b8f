"""A parameter-server job on a node Ray drains (`undying drain-node`, a worker pod's preStop hook):
the supervisor cuts the segment at an exact step, saves it, and moves the node's servers and workers
off it (paramserver.moves); the node then goes, and the job ends as the failure-free run does, bit for
bit (bsp), with nothing redone and no failure."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.ray.jobs import ROOT, UNDYING

pytestmark = [pytest.mark.ray, pytest.mark.heavy]
PS_CLASSES = ("ServerActor", "WorkerActor")


def _cmd(address: str, tmp_path, name: str, report) -> list[str]:
    cmd = [UNDYING, "run", str(ROOT / "examples/ps.yaml"), "--address", address, "--report", str(report)]
    for item in [f"name={name}", "parallel.consistency=bsp", "parallel.staleness=null", "train.steps=200",
                 "checkpoint.every_steps=100", f"checkpoint.url=file://{tmp_path}/ckpt"]:
        cmd += ["--set", item]
    return cmd


def _ps_nodes(address: str) -> dict[str, list[str]]:
    """{node id: the class names of the PS actors alive there}."""
    probe = (f"import json, ray, ray._private.state; ray.init(address={address!r}, logging_level='ERROR'); "
             "alive = ray._private.state.actors(actor_state_name='ALIVE').values(); "
             "print(json.dumps([(a['Address']['NodeID'], a['ActorClassName']) for a in alive "
             f"if a['ActorClassName'] in {PS_CLASSES!r}]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    nodes: dict[str, list[str]] = {}
    for node, name in json.loads(out.stdout.strip().splitlines()[-1]):
        nodes.setdefault(node, []).append(name)
    return nodes


def test_a_drained_node_s_ps_actors_move_off_at_a_saved_cut_and_nothing_is_redone(local_cluster, tmp_path):
    try:
        reference = subprocess.run(_cmd(local_cluster.address, tmp_path, "ps-ref", tmp_path / "ref.json"),
                                   capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
        expected = json.loads((tmp_path / "ref.json").read_text())
        log = tmp_path / "drain.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(_cmd(local_cluster.address, tmp_path, "ps-drain", tmp_path / "drain.json"),
                                    stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        deadline = time.monotonic() + 240  # drained once every actor runs: the cut falls in the first segment
        while len(nodes := _ps_nodes(local_cluster.address)) < 2 or sum(map(len, nodes.values())) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        node_id = next(node for node, names in nodes.items() if "ServerActor" in names)
        drain = subprocess.run([UNDYING, "drain-node", "--address", local_cluster.address, "--node-id", node_id,
                                "--wait", "120", "--reason", "spot reclaim"], capture_output=True, text=True,
                               timeout=180)
        assert drain.returncode == 0, drain.stdout + drain.stderr + log.read_text()[-3000:]
        assert node_id not in _ps_nodes(local_cluster.address)
        [node] = [n for n in local_cluster.nodes if n.node_id == node_id]
        local_cluster.cluster.remove_node(node, allow_graceful=False)  # the pod ends
        local_cluster.nodes.remove(node)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        result = json.loads((tmp_path / "drain.json").read_text())
        text = log.read_text()
        moved = [line for line in result["moves"] if line.startswith("server")]
        assert moved and all("moved off draining node(s)" in line for line in moved), text[-3000:]
        assert result["failures"] == [] and result["steps_redone"] == 0
        assert result["goodput"]["badput_s"]["lost_work"] == 0.0
        cut = [step for step in result["checkpoints"] if step % 100]
        assert len(cut) == 1, result["checkpoints"]
        assert result["losses"] == expected["losses"]  # bsp: bit for bit the failure-free run
        print(f"drained node held {nodes[node_id]}; cut at step {cut[0]}; {result['moves']}")
    finally:
        local_cluster.restore(3)
