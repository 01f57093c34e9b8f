"""A warm spare whose warm-up raised (a device error, an import failure) or that died idle is dropped
and killed, its seat freed; it never fails the job through the pool's watch or a promotion."""

from __future__ import annotations

import types

from ray.exceptions import ActorDiedError, RayTaskError

from orchestrator.cluster import spare_seats, worker_group
from orchestrator.cluster.worker_group import RayWorkerGroup


class _Ref:
    def __init__(self, answer=None, error=None, silent=False):
        self.answer, self.error, self.silent = answer, error, silent  # silent: never answers (a hung actor)


class _Spare:
    def __init__(self, hexid: str, pong: _Ref):
        self._actor_id = types.SimpleNamespace(hex=lambda: hexid)
        self.ping = types.SimpleNamespace(remote=lambda: pong)


def _group(monkeypatch, spares: dict) -> tuple[RayWorkerGroup, list]:
    killed = []

    def get(ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.answer

    def wait(refs, num_returns=1, timeout=None):
        return [r for r in refs if not r.silent], [r for r in refs if r.silent]

    fake = types.SimpleNamespace(wait=wait, get=get,
                                 kill=lambda actor, no_restart=True: killed.append(actor))
    monkeypatch.setattr(worker_group, "ray", fake)
    monkeypatch.setattr(spare_seats, "ray", fake)
    monkeypatch.setattr(worker_group.interruptible, "ray", fake)
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group.spares, group.node_of_actor, group.lost_nodes, group.pg, group.silent_spares = spares, {}, set(), None, {}
    group.interrupted = lambda: False
    group._remember_node = lambda actor, info: group.node_of_actor.update({actor._actor_id.hex(): info["node"]})
    return group, killed


def test_a_spare_whose_warm_up_raised_or_that_died_is_dropped_not_fatal(monkeypatch):
    failed = RayTaskError("warm_up", "torch.OutOfMemoryError: CUDA out of memory", RuntimeError("oom"))
    good, bad = _Spare("aa", _Ref({"node": "n1"})), _Spare("bb", _Ref({"node": "n1"}))
    group, killed = _group(monkeypatch, {0: (good, _Ref({"node": "n1"})), 1: (bad, _Ref(error=failed))})
    assert group.ready_spares() == [0]
    assert set(group.spares) == {0} and killed == [bad]

    dead = _Spare("cc", _Ref(error=ActorDiedError()))
    group.spares[2] = (dead, _Ref({"node": "n2"}))
    assert group.live_ready_spares() == [0]
    assert set(group.spares) == {0} and killed == [bad, dead]


def test_spares_on_draining_nodes_are_dropped_and_killed(monkeypatch):
    here, there = _Spare("aa", _Ref({"node": "n1"})), _Spare("bb", _Ref({"node": "n2"}))
    group, killed = _group(monkeypatch, {0: (here, _Ref({"node": "n1"})), 1: (there, _Ref({"node": "n2"}))})
    group.node_of_actor = {"aa": "n1", "bb": "n2"}
    assert group.drop_spares_on({"n2", "n9"}) == 1
    assert set(group.spares) == {0} and killed == [there]


def test_a_lost_node_s_spare_still_warming_is_dropped_by_its_seat(monkeypatch):
    warming = _Spare("cc", _Ref({"node": "n2"}))
    group, killed = _group(monkeypatch, {3: (warming, _Ref({"node": "n2"}))})
    group.pg, group.seat_bundle = "pg", [0, 0, 1, 1]  # seat 3 is in bundle 1, which Ray placed on n2
    monkeypatch.setattr(worker_group.ray, "util", types.SimpleNamespace(
        placement_group_table=lambda pg: {"bundles_to_node_id": {"0": "n1", "1": "n2"}}), raising=False)
    assert group.drop_spares_on({"n2"}) == 1 and group.spares == {} and killed == [warming]


def test_a_warm_spare_that_answers_no_ask_three_times_in_a_row_is_hung_killed_and_its_seat_freed(monkeypatch):
    """A SIGSTOPped or wedged spare would otherwise cost every promotion and every grow's count the ask's
    timeout for the rest of the job, its seat never refilled."""
    good, hung = _Spare("aa", _Ref({"node": "n1"})), _Spare("bb", _Ref(silent=True))
    group, killed = _group(monkeypatch, {0: (good, _Ref({"node": "n1"})), 1: (hung, _Ref({"node": "n1"}))})
    for _ in range(spare_seats.SILENT_ASKS - 1):
        assert group.live_ready_spares() == [0] and set(group.spares) == {0, 1}  # slow is no proof yet
    assert group.live_ready_spares() == [0] and set(group.spares) == {0} and killed == [hung]
    slow = _Spare("cc", _Ref(silent=True))
    group.spares[1] = (slow, _Ref({"node": "n1"}))  # the seat's next spare starts with a clean count
    assert group.live_ready_spares() == [0] and set(group.spares) == {0, 1} and group.silent_spares == {"cc": 1}
