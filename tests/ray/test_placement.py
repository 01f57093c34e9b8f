"""Placement on the multi-node test cluster (3 worker nodes of 2 `undying_slot`s each).

Each TP group is one placement-group bundle, so it always lands on one node; `pack` puts the
groups on as few nodes as possible and `spread` on as many. A TP group larger than any node is
refused before anything is reserved, naming `parallel.tp` (never an endless wait).
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray
SHORT = ["train.steps=4", "checkpoint.every_steps=2", "chaos.faults=[]"]


def _placement_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if "rank actors up on" in line)


@pytest.mark.parametrize(("placement", "nodes"), [("pack", 1), ("spread", 2)])
def test_dp_replicas_pack_or_spread_over_nodes(ray_cluster, tmp_path, placement, nodes):
    proc, _ = run_job(ray_cluster, tmp_path, f"place{placement}", [
        *SHORT, "parallel.dp=2", f"resources.placement={placement}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = _placement_line(proc.stdout)
    assert f"2 rank actors up on {nodes} node(s)" in line and f"2 rank(s) over {nodes} node(s) ({placement})" in line


# Heavy (about 25 s on two cores): tests/unit/test_placement.py keeps TP groups whole per bundle and node,
# the dp test above spreads replicas over nodes, and tests/ray/test_sharded_job.py places whole TP groups.
@pytest.mark.heavy
def test_spread_tp_groups_stay_whole_on_distinct_nodes(ray_cluster, tmp_path):
    proc, _ = run_job(ray_cluster, tmp_path, "placetp", [
        *SHORT, "parallel.dp=2", "parallel.tp=2", "train.micro_batch=4", "resources.placement=spread"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each TP group on one node, 2 TP group(s) over 2 node(s) (spread)" in _placement_line(proc.stdout)


def test_a_tp_group_larger_than_any_node_is_refused_at_once(ray_cluster, tmp_path):
    started = time.monotonic()
    proc, _ = run_job(ray_cluster, tmp_path, "placebig", [
        *SHORT, "parallel.dp=1", "parallel.tp=4", "train.micro_batch=4"], timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parallel.tp" in proc.stderr and "a TP group of 4 ranks must sit on one node" in proc.stderr
    assert time.monotonic() - started < 60


def _kill(ray, actor) -> None:
    """Kill `actor` and wait until Ray says it is dead: ray.kill is asynchronous, and a call sent at
    once can still run before the kill lands (seen on a loaded machine)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers after 60 s")


@contextlib.contextmanager
def _worker_group(ray_cluster: str, name: str, overrides: tuple[str, ...] = ()):
    """(ray, a RayWorkerGroup of the demo job) connected to the test cluster; shut down after."""
    import ray

    from orchestrator.cluster.worker_group import RayWorkerGroup
    from orchestrator.spec.job_spec import load_spec
    from tests.ray.jobs import BASE, ROOT

    spec = load_spec(str(ROOT / "examples/demo.yaml"), [*BASE, f"checkpoint.url=memory://{name}", *overrides])
    ray.init(address=ray_cluster, logging_level="ERROR")
    workers = RayWorkerGroup(spec)
    try:
        yield ray, workers
    finally:
        workers.shutdown()
        ray.shutdown()


def test_an_actor_that_dies_while_starting_is_started_again(ray_cluster):
    # Ray's memory monitor kills actors while a node is short of memory, and a process can crash
    # in its start-up; no rank holds state yet, so placement starts that seat's actor again.
    with _worker_group(ray_cluster, "restart-ping") as (ray, workers):
        workers.place(4)
        workers.ensure_actors([0, 1, 2, 3])
        doomed = workers.actors[2]
        _kill(ray, doomed)
        pings = workers.ping_all(timeout_s=120)
        assert len(pings) == 4 and all(p.get("node") for p in pings)
        assert workers.actors[2] is not doomed
        _kill(ray, workers.actors[1])
        with pytest.raises(ray.exceptions.RayActorError):
            workers.ping_all(timeout_s=120, restarts=0)  # no restart allowed: the death is an error


def test_a_warm_spare_that_died_idle_is_not_promoted(ray_cluster):
    # Ray keeps a finished call's answer: a spare that warmed up and then died (its memory monitor, a
    # crash) still looks warm by its warm-up call; promotion asks it once more.
    with _worker_group(ray_cluster, "dead-spare") as (ray, workers):
        workers.place(2, spares=2)
        workers.ensure_actors([0, 1])
        workers.start_spares()
        deadline = time.monotonic() + 120
        while len(workers.ready_spares()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        first, second = workers.ready_spares()
        _kill(ray, workers.spares[first][0])
        assert workers.ready_spares() == [first, second]  # the stale answer: still "warm"
        assert workers.live_ready_spares() == [second]
        assert workers.promote_spares([5]).left == [] and workers.bundle_of[5] == second


def test_a_cold_replacement_keeps_its_own_seat_beside_its_tp_group(ray_cluster):
    with _worker_group(ray_cluster, "own-seat") as (ray, workers):
        workers.place(2, spares=1)  # seat 2 stays free: no spare is started in it
        workers.ensure_actors([0, 1])
        workers.ping_all(timeout_s=120)
        _kill(ray, workers.actors[1])
        assert workers.free_bundles() == [2]
        assert workers.replace_cold([1], timeout_s=120) == []
        assert workers.bundle_of[1] == 1  # its own healthy seat, not the free one


def test_a_tp_group_whose_node_has_no_spare_moves_whole_onto_the_spare_group_s_node(ray_cluster):
    # Three nodes of two slots: TP groups {0, 1} and {2, 3} and the spare group, one node each. Rank 1
    # dies; a spare on another node would split its group (every layer's all-reduce across nodes), so
    # the group moves to the spares' node and rank 0's process becomes the spare of its seat.
    with _worker_group(ray_cluster, "tp-move", ("parallel.dp=2", "parallel.tp=2", "train.micro_batch=4",
                                                "resources.placement=spread")) as (ray, workers):
        workers.place(4, spares=2)
        workers.ensure_actors([0, 1, 2, 3])
        workers.ping_all(timeout_s=120)
        workers.start_spares()
        deadline = time.monotonic() + 120
        while len(workers.ready_spares()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        survivor, spare_node = workers.actors[0], workers.spare_node(4)
        assert spare_node not in {workers.node_of(0), workers.node_of(2)}
        _kill(ray, workers.actors[1])
        workers.kill(1)
        choice = workers.promote_spares([1])
        assert choice.moved == [0] and choice.left == [] and sorted(choice.seats.values()) == [4, 5]
        assert workers.node_of(0) == workers.node_of(1) == spare_node
        assert workers.spares[0][0]._actor_id == survivor._actor_id and workers.free_bundles() == [1]
        deadline = time.monotonic() + 60
        while workers.ready_spares() != [0] and time.monotonic() < deadline:  # warm already: a ping
            time.sleep(0.1)
        assert workers.ready_spares() == [0]


# Heavy (a whole job, about 40 s on two cores): the worker-group test above keeps the move in the default suite.
@pytest.mark.heavy
def test_a_job_whose_rank_dies_keeps_its_tp_group_on_one_node(ray_cluster, tmp_path):
    # The same three groups of seats as above, in a whole job: rank 1 is killed at step 6, its group
    # moves onto the spares' node, and the job ends as the failure-free run would.
    proc, report = run_job(ray_cluster, tmp_path, "placemove", [
        "train.steps=12", "checkpoint.every_steps=4", "parallel.dp=2", "parallel.tp=2", "train.micro_batch=4",
        "resources.placement=spread", "elastic.spares=2", "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 6}]"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "live rank(s) [0] moved with them to keep their TP group on one node" in proc.stdout, proc.stdout[-3000:]
    assert "span nodes" not in proc.stdout
    assert json.loads(report.read_text())["final_step"] == 12


def test_ranks_that_do_not_see_the_driver_s_file_root_are_refused_at_placement(ray_cluster, tmp_path):
    # A file:// root on storage only the driver's node has: the ranks elsewhere find no claim there.
    from ckpt.owner_claims import visibility_proof
    from ckpt.ownership import OwnerLease
    from ckpt.storage import Storage
    from orchestrator.cluster.shared_root import RootNotShared

    storage = Storage(f"file://{tmp_path}/job")
    lease = OwnerLease.claim(storage, "driver", lease_s=600.0)
    try:
        with _worker_group(ray_cluster, "shared-root") as (ray, workers):
            workers.root_proof = visibility_proof(storage)  # the folder every node here shares
            workers.place(2)
            workers.ensure_actors([0, 1])
            assert all(p["sees_root"] for p in workers.ping_all(timeout_s=120))
            path, token = workers.root_proof
            workers.root_proof = (path.replace(str(tmp_path), str(tmp_path / "other-node")), token)
            workers.kill(1)
            workers.ensure_actors([1])  # a rank started where the folder is another one
            with pytest.raises(RootNotShared, match="does not see the driver's claim"):
                workers.ping_all(timeout_s=120)
    finally:
        lease.release()
