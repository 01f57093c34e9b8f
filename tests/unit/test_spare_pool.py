"""The spare pool: how many spares a job keeps (`elastic.spares`, `auto`), and how the pool refills
itself after a spare takes over, with a seat-level fake of the worker group (pure, no Ray)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from monitor.metrics import JobMetrics
from orchestrator.cluster.capacity import capacity_problems, node_problems, resolve_spares, slots
from orchestrator.cluster.placement import SpareChoice, choose_seats
from orchestrator.controller.policies import ScalingPolicy
from orchestrator.controller.recovery import Recovery
from orchestrator.controller.spare_pool import SparePool
from orchestrator.spec.job_spec import SpecError, load_spec
from orchestrator.wire.store import RendezvousServer

ROOT = Path(__file__).resolve().parents[2]


def _load(*overrides: str):
    return load_spec(str(ROOT / "examples/demo.yaml"), ["checkpoint.url=memory://spares", *overrides])


# ---- how many spares ----------------------------------------------------------------------------

def test_spares_default_to_auto_and_bad_values_name_the_field():
    assert _load().elastic.spares == "auto"
    assert _load("elastic.spares=0").elastic.spares == 0
    for bad in ("-1", "two", "true", "1.5"):
        with pytest.raises(SpecError) as err:
            _load(f"elastic.spares={bad}")
        [problem] = err.value.problems
        assert problem.field == "elastic.spares"
        assert "whole number >= 0" in problem.message and "'auto'" in problem.message


def test_auto_keeps_one_spare_tp_group_when_the_cluster_has_room():
    spec = _load()  # 4 ranks x 1 CPU
    spares, note = resolve_spares(spec, {"CPU": 5.0}, [{"CPU": 5.0}])
    assert spares == 1 and "one spare kept warm (1 CPU and one more actor's memory)" in note
    assert slots(spec) == 5
    tp2 = _load("parallel.dp=2", "parallel.tp=2", "model.n_heads=4")
    assert resolve_spares(tp2, {"CPU": 6.0}, [{"CPU": 2.0}] * 3)[0] == 2  # a whole TP group, on its own node


def test_auto_falls_back_to_no_spare_when_it_does_not_fit():
    spec = _load()
    spares, note = resolve_spares(spec, {"CPU": 4.0}, [{"CPU": 8.0}])  # another job holds 4 of 8 CPUs
    assert spares == 0 and "no spare, the cluster's free CPU cannot hold one spare (1 CPU)" in note
    tp2 = _load("parallel.dp=2", "parallel.tp=2", "model.n_heads=4")
    spares, note = resolve_spares(tp2, {"CPU": 7.0}, [{"CPU": 3.0}] * 2 + [{"CPU": 1.0}])  # 7 free, 2 groups fit
    assert spares == 0 and "no node has room for one spare TP group of 2" in note
    # The job that fits without a spare still fits: auto is never counted as a requirement.
    assert capacity_problems(spec, {"CPU": 4.0}) == [] and node_problems(tp2, [{"CPU": 3.0}] * 2) == []


def test_an_explicit_number_is_kept_or_refused_naming_elastic_spares():
    assert resolve_spares(_load("elastic.spares=3"), {"CPU": 0.0}, []) == (3, None)
    [problem] = capacity_problems(_load("elastic.spares=3"), {"CPU": 5.0})
    assert problem.field == "elastic.spares" and "room for 1 spare(s)" in problem.message
    [problem] = capacity_problems(_load("elastic.spares=3"), {"CPU": 2.0})  # the ranks alone do not fit
    assert problem.field == "resources.cpus_per_rank"
    tp2 = _load("parallel.dp=2", "parallel.tp=2", "model.n_heads=4", "elastic.spares=2")
    [problem] = node_problems(tp2, [{"CPU": 3.0}] * 2 + [{"CPU": 1.0}])
    assert problem.field == "elastic.spares" and "nodes hold 2 group(s), 2 of them for the ranks" in problem.message
    assert node_problems(tp2, [{"CPU": 2.0}] * 3) == []


# ---- refilling ----------------------------------------------------------------------------------

class SeatWorkers:
    """The worker group's spare bookkeeping, seat by seat (RayWorkerGroup's rules, no actors).

    `seats` = ranks + spares at placement; `actors[rank]` is the seat a rank's actor sits in;
    `spares[seat]` says whether that seat's spare is warm. A spare warms when a test says so."""

    def __init__(self, world: int, spares: int):
        self.seats = world + spares
        self.actors = {rank: rank for rank in range(world)}
        self.bundle_of = dict(self.actors)
        self.spares: dict[int, bool] = {}
        self.lost_seats: set[int] = set()  # seats on a lost node, not yet re-placed by Ray
        self.draining_seats: set[int] = set()  # seats on the nodes Ray drains (whichever a test names)
        self.polls = 0
        self.awaited: list[tuple[list[int], int, float]] = []  # each await_spares call
        self.warms_while_awaited = False  # does a spare still warming finish during an await?
        self.await_takes_s = 0.0  # how long an await_spares call waits
        self.cold: list[int] = []  # ranks given new actors
        self.cold_timeouts: list[float] = []  # each replace_cold call's limit

    def node_of(self, rank: int) -> str:
        return "n1"  # one node: a shrink's renumbering keeps the ranks' order

    def free_seats(self) -> list[int]:
        used = set(self.bundle_of.values()) | set(self.spares) | self.lost_seats
        return [seat for seat in range(self.seats) if seat not in used]

    def start_spares(self, avoid: set[str] = frozenset()) -> list[int]:
        free = [seat for seat in self.free_seats() if not (avoid and seat in self.draining_seats)]
        self.spares.update(dict.fromkeys(free, False))
        return free

    def ready_spares(self) -> list[int]:
        self.polls += 1
        return sorted(seat for seat, warm in self.spares.items() if warm)

    def spare_seats(self) -> list[int]:
        return sorted(self.spares)

    def live_ready_spares(self) -> list[int]:
        return self.ready_spares()

    def drop_spares_on(self, nodes: set[str]) -> int:
        gone = [seat for seat in self.spares if nodes and seat in self.draining_seats]
        for seat in gone:
            del self.spares[seat]
        return len(gone)

    def promote_spares(self, ranks: list[int]) -> SpareChoice:
        ready, seats, left = self.ready_spares(), {}, []
        for rank in ranks:
            if not ready:
                left.append(rank)
                continue
            seat = seats[rank] = ready.pop(0)
            del self.spares[seat]
            self.actors[rank] = self.bundle_of[rank] = seat
        return SpareChoice(seats, [], left)

    def promotable_spares(self) -> int:
        return len(self.live_ready_spares())

    def await_spares(self, seats: list[int], count: int, timeout_s: float) -> None:
        self.awaited.append((seats, count, timeout_s))
        time.sleep(timeout_s if self.await_takes_s is None else self.await_takes_s)
        if self.warms_while_awaited:
            self.warm_all()

    def _choice(self, ranks: list[int], draining: set[str]):
        return choose_seats(ranks, self.bundle_of, self.free_seats(), self.lost_seats,
                            self.draining_seats if draining else set())

    def stranded(self, ranks: list[int], draining: set[str]) -> list[int]:
        return self._choice(ranks, draining).stranded

    def replace_cold(self, ranks: list[int], timeout_s: float, draining: set[str] = frozenset()) -> list[int]:
        choice = self._choice(ranks, draining)
        self.cold_timeouts.append(timeout_s)
        for rank in ranks:
            self.cold.append(rank)
            if rank in choice.waiting:  # Ray starts nothing in its seat within the timeout
                self.bundle_of.pop(rank)
                self.spares[choice.seats[rank]] = False
            else:
                self.actors[rank] = self.bundle_of[rank] = choice.seats[rank]
        return choice.waiting

    def renumber(self, keep: list[int]) -> None:
        self.actors = {new: self.actors[old] for new, old in enumerate(keep)}
        self.bundle_of = {new: self.bundle_of[old] for new, old in enumerate(keep)}

    def kill(self, rank: int) -> None:
        self.actors.pop(rank)

    def warm_all(self) -> None:
        self.spares = dict.fromkeys(self.spares, True)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _recovery(spec, workers, lines, draining=tuple):
    policy = ScalingPolicy.for_spec(spec)
    recovery = Recovery(spec, workers, policy, lines.append, release_timeout_s=1.0, poll_s=0.01,
                        metrics=JobMetrics(spec.name), draining=draining)
    recovery.spares.clock = Clock()
    return recovery


def _started(recovery) -> float:
    return recovery.spares.metrics.registry.get_sample_value("undying_spares_started_total", {"undying_job": "demo"})


def _ready(recovery) -> float:
    return recovery.spares.metrics.registry.get_sample_value("undying_spares_ready", {"undying_job": "demo"})


def test_a_consumed_spare_is_replaced_in_the_freed_seat_and_takes_the_next_failure():
    spec, workers, lines = _load("elastic.spares=1"), SeatWorkers(4, 1), []
    recovery = _recovery(spec, workers, lines)
    assert recovery.spares.refill("placement") == [4]
    workers.warm_all()
    recovery.spares.watch(settled=True)
    assert "spare pool: the new spare in seat 4 is warm, 0.0 s after it was started (1 of 1" in lines[-1]

    workers.kill(1)  # the first failure: the warm spare in seat 4 becomes rank 1
    membership = recovery.replace([1], 4)
    assert "rank(s) [1] taken over by warm spares" in membership.words
    assert workers.actors[1] == 4 and workers.spare_seats() == []
    recovery.spares.watch(settled=False)  # restoring: the new spare would compete with the restore
    assert workers.spare_seats() == []
    recovery.spares.watch(settled=True)  # the first step after the restart: a new spare in the dead rank's seat
    assert workers.spare_seats() == [1]
    assert "spare pool: rank(s) [1] replaced, training again; 1 new spare(s) warming up in the background in " \
           "seat(s) [1] (0 of 1 warm now)" in lines[-1]
    assert (_started(recovery), _ready(recovery)) == (2, 0)

    recovery.spares.clock.now += 3.5
    recovery.spares.watch(settled=True)
    assert not lines[-1].startswith("spare pool: the new spare in seat 1")  # still warming: nothing said
    workers.warm_all()
    recovery.spares.watch(settled=True)
    assert lines[-1].startswith("spare pool: the new spare in seat 1 is warm, 3.5 s after it was started")
    assert _ready(recovery) == 1

    workers.kill(2)  # the second failure: taken by the new spare, and the pool refills again
    assert "rank(s) [2] taken over by warm spares" in recovery.replace([2], 4).words
    recovery.spares.watch(settled=True)
    assert workers.actors[2] == 1 and workers.spare_seats() == [2] and _started(recovery) == 3


def test_a_kill_while_the_new_spare_warms_waits_for_it_instead_of_starting_a_second_actor():
    spec, workers, lines = _load("elastic.spares=1"), SeatWorkers(4, 1), []
    recovery = _recovery(spec, workers, lines)
    recovery.spares.refill("placement")
    recovery.spares.clock.now += 12.0
    workers.warm_all()
    recovery.spares.watch(settled=True)  # the first warm-up took 12 s: waits are bounded by 24 s from now on
    workers.kill(1)
    recovery.replace([1], 4)
    recovery.spares.watch(settled=True)  # a new spare in seat 1, warming
    recovery.spares.clock.now += 4.0
    workers.kill(2)  # 4 s into its warm-up: it is waited for (at most 24 - 4 s), no new actor is started
    workers.warms_while_awaited = True
    membership = recovery.replace([2], 4)
    assert workers.awaited == [([1], 1, 20.0)] and workers.cold == []
    assert workers.actors[2] == 1 and "rank(s) [2] taken over by a spare that finished warming up" in membership.words
    assert any(line.startswith("spare pool: the new spare in seat 1 is warm, 4.0 s") for line in lines)

    recovery.spares.watch(settled=True)  # the next spare, in seat 2, never warms (its resources are gone)
    workers.warms_while_awaited = False
    recovery.spares.clock.now += 30.0
    workers.kill(3)  # past twice the longest warm-up: not waited for, a new actor at once
    assert "rank(s) [3] replaced by new actors" in recovery.replace([3], 4).words
    assert len(workers.awaited) == 1 and workers.cold == [3]
    assert recovery.spares.wait_for_warming_s(60.0) == 0.0


def test_the_wait_for_a_warming_spare_and_the_new_actors_share_one_replace_timeout():
    spec, workers, lines = _load("elastic.spares=1", "elastic.replace_timeout_s=1.0"), SeatWorkers(4, 1), []
    recovery = _recovery(spec, workers, lines)
    recovery.spares.refill("placement")  # warming, and it never warms (its seat's resources are gone)
    workers.await_takes_s = None  # the await waits out what it is given
    workers.kill(1)
    recovery.replace([1], 4)
    assert workers.awaited[0][2] == 0.5 and workers.cold == [1]  # half the limit for the spare...
    assert 0.35 <= workers.cold_timeouts[0] <= 0.5, workers.cold_timeouts  # ...what it left for a new actor


def test_a_quiet_poll_asks_nothing_and_a_spare_lost_while_warming_is_said():
    spec, workers, lines = _load("elastic.spares=1"), SeatWorkers(4, 1), []
    recovery = _recovery(spec, workers, lines)
    recovery.spares.refill("placement")
    polls = workers.polls
    workers.spares.clear()  # its node was lost before it warmed up
    recovery.spares.watch(settled=True)
    assert lines[-1] == "spare pool: the new spare in seat 4 left the pool before it was seen warm"
    polls = workers.polls
    for _ in range(10):
        recovery.spares.watch(settled=True)
    assert workers.polls == polls  # nothing warming: no Ray call per poll


def test_seats_on_a_lost_node_get_their_spares_back_at_a_commit_once_ray_re_places_them():
    spec, workers, lines = _load("elastic.spares=2"), SeatWorkers(4, 2), []
    recovery = _recovery(spec, workers, lines)
    recovery.spares.refill("placement")
    workers.warm_all()
    workers.lost_seats = {0, 1}  # the node of ranks 0 and 1 is lost
    for rank in (0, 1):
        workers.kill(rank)
    recovery.replace([0, 1], 4)
    recovery.spares.watch(settled=True)
    assert (workers.actors[0], workers.actors[1]) == (4, 5) and workers.spare_seats() == []  # nowhere to refill
    assert recovery.grow_to(4, 4) is None and workers.spare_seats() == []  # a commit: still on the lost node
    workers.lost_seats = set()  # Ray re-placed the bundles on a live node
    assert recovery.grow_to(4, 4) is None
    assert workers.spare_seats() == [0, 1] and "at a commit, seat(s) free again" in lines[-1]


def _drained(spec, world: int, seats: set[int]):
    """A job whose ranks in `seats` sat on a node Ray drains (forgotten, as Stops does at the stop step)."""
    workers, lines, nodes = SeatWorkers(world, spec.elastic.spares), [], {"n2"}
    recovery = _recovery(spec, workers, lines, draining=lambda: nodes)
    workers.lost_seats, workers.draining_seats = set(seats), set(seats)
    for rank in seats:
        workers.kill(rank)
    return recovery, workers, lines, nodes


def test_a_drained_node_s_ranks_with_no_free_seat_shrink_dp_at_once_and_grow_back_when_it_has_gone():
    spec = _load("elastic.spares=0", "elastic.min_dp=1")
    recovery, workers, lines, nodes = _drained(spec, 4, {0, 1})
    membership = recovery.replace([0, 1], 4)
    # No new actor waits replace_timeout_s for a seat Ray starts nothing in until the node has gone.
    assert membership.dp == 2 and workers.cold == [], membership.words
    assert "rank(s) [0, 1] not replaced: their seats are on a draining node" in membership.words
    assert membership.words.endswith("shrinking dp 4 -> 2 (grad accumulation absorbs it)")
    assert sorted(workers.actors.values()) == [2, 3]  # the survivors, renumbered 0 and 1
    recovery.spares.watch(settled=True)
    assert recovery.grow_to(2, 2) is None and workers.spare_seats() == []  # a commit: the node still drains
    nodes.clear()  # the node has gone and Ray re-placed its bundles on a live node
    workers.lost_seats = workers.draining_seats = set()
    assert recovery.grow_to(2, 2) is None and workers.spare_seats() == [0, 1]  # spares warming there
    workers.warm_all()
    assert recovery.grow_to(2, 2) == (4, 2)


def test_a_drained_node_s_ranks_wait_for_their_seats_when_dp_may_not_shrink():
    spec = _load("elastic.spares=0", "elastic.min_dp=4")
    recovery, workers, lines, _ = _drained(spec, 4, {1})
    membership = recovery.replace([1], 4)
    assert workers.cold == [1] and membership.error is not None  # waited, then could not shrink
    assert "cannot shrink: 3 rank(s) hold dp 3, below elastic.min_dp=4" in membership.error


def test_a_drained_node_s_rank_takes_a_free_seat_elsewhere_before_any_shrink():
    spec = _load("elastic.spares=1", "elastic.min_dp=1")
    recovery, workers, lines, _ = _drained(spec, 4, {1})
    membership = recovery.replace([1], 4)  # the spare seat 4 is free (its spare not started yet)
    assert membership.dp == 4 and workers.cold == [1] and workers.actors[1] == 4, membership.words


def test_seats_for_new_actors_prefer_their_own_then_a_free_one_on_a_node_that_stays():
    own = {0: 0, 1: 1, 2: 2}
    choice = choose_seats([0, 1, 2], own, free=[5, 6, 7], on_lost={0, 6}, on_draining={1, 5})
    assert choice.seats == {0: 7, 1: 1, 2: 2} and choice.waiting == [1] and choice.stranded == [1]
    choice = choose_seats([0, 2], own, free=[], on_lost={0}, on_draining=set())
    assert choice.seats == {0: 0, 2: 2} and choice.waiting == [0] and choice.stranded == []
    assert choose_seats([3], own, free=[4], on_lost=set(), on_draining=set()).seats == {3: 4}  # no seat of its own
    assert choose_seats([3], own, free=[], on_lost=set(), on_draining=set()).seats == {3: 3}


def test_no_spares_keeps_today_s_behaviour():
    spec, workers, lines = _load("elastic.spares=0"), SeatWorkers(4, 0), []
    recovery = _recovery(spec, workers, lines)
    workers.kill(1)
    assert recovery.replace([1], 4).words == "rank(s) [1] replaced by new actors"
    recovery.spares.watch(settled=True)
    assert workers.spare_seats() == [] and lines == [] and recovery.grow_to(4, 4) is None
    assert SparePool(_load(), workers, None, print).target == 0  # an unresolved auto keeps none


@pytest.fixture
def rendezvous():
    return RendezvousServer("127.0.0.1")


def test_the_controller_refills_the_pool_so_a_second_kill_is_taken_by_the_new_spare(tmp_path, rendezvous):
    from ckpt.storage import Storage
    from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec

    spec = _spec(tmp_path, elastic={"spares": 1, "max_restarts": 2})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), die_at={12: 0, 25: 1})
    lines: list[str] = []
    report = _controller(spec, workers, rendezvous, lines).run()
    assert report.status == "succeeded", report.error
    assert workers.created == [0, 1]  # no cold actor: both failures were taken by spares
    pool = [line.split("] ", 1)[1] for line in lines if "spare pool:" in line or "taken over" in line]
    # (The job ends 5 steps after the second kill, before a poll makes its deferred refill.)
    assert [line.split(";")[0] for line in pool if "warming up in the background" in line][:2] == [
        "spare pool: placement", "spare pool: rank(s) [0] replaced, training again"]
    assert sum("taken over by warm spares" in line for line in pool) == 2
    assert sum("is warm" in line for line in pool) >= 2  # the first spare, and its replacement before the 2nd kill


def test_a_commit_during_a_drain_neither_refills_nor_grows_onto_the_draining_node():
    # Ray drains node n2 (seats 4 and 5, whose spares are warm): a commit's refill starts no spare in its
    # free seats, and a grow counts none of its spares (the ranks grown there would move again at once).
    spec = _load("elastic.spares=2", "elastic.min_dp=1")
    workers, lines, nodes = SeatWorkers(4, 2), [], set()
    recovery = _recovery(spec, workers, lines, draining=lambda: nodes)
    recovery.spares.refill("placement")
    workers.warm_all()
    workers.draining_seats, nodes = {4, 5}, {"n2"}
    for rank in (2, 3):  # a failure shrank the job to dp 2; seats 2 and 3 are free
        workers.kill(rank)
    del workers.bundle_of[2], workers.bundle_of[3]
    workers.draining_seats |= {2, 3}
    assert recovery.grow_to(2, 2) is None  # no spare left off n2 to grow onto
    assert workers.spare_seats() == [] and "spares on draining node(s) n2 dropped" in "\n".join(lines)
