"""Shutting the worker group down tries every step: a kill that fails (a GCS that stopped answering)
leaves no other actor running and no placement group reserved; the first error is raised after."""

from __future__ import annotations

import types

import pytest

from orchestrator.cluster import worker_group
from orchestrator.cluster.worker_group import RayWorkerGroup


def test_one_failed_kill_does_not_keep_the_others_or_the_placement_group(monkeypatch):
    killed, removed = [], []

    def kill(actor, no_restart=True):
        if actor == "rank-0":
            raise ConnectionError("GCS unavailable")
        killed.append(actor)

    monkeypatch.setattr(worker_group, "ray", types.SimpleNamespace(kill=kill))
    monkeypatch.setattr(worker_group, "remove_placement_group", removed.append)
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group.actors, group._train_refs = {0: "rank-0", 1: "rank-1"}, {}
    group.spares, group.pg = {2: ("spare-2", None)}, "pg"
    with pytest.raises(ConnectionError, match="GCS unavailable"):
        group.shutdown()
    assert killed == ["rank-1", "spare-2"] and removed == ["pg"]
    assert group.actors == {} and group.spares == {} and group.pg is None


def test_a_rank_whose_call_says_it_is_unreachable_is_killed_not_only_forgotten(monkeypatch):
    # ActorUnavailableError is a RayActorError meaning "unreachable now", not dead: a dropped handle
    # alone would leave its process (and its GPU) alive while a buddy holds another handle to it.
    from ray.exceptions import ActorUnavailableError

    killed = []

    def get(ref):
        raise ActorUnavailableError("the actor is temporarily unavailable", None)

    monkeypatch.setattr(worker_group, "ray", types.SimpleNamespace(
        wait=lambda refs, num_returns, timeout: (list(refs), []), get=get,
        kill=lambda actor, no_restart=True: killed.append(actor)))
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group.actors, group._train_refs = {0: "rank-0", 1: "rank-1"}, {"ref-1": 1}
    [outcome] = group.wait_any(0.1)
    assert outcome.rank == 1 and outcome.status == "died" and killed == ["rank-1"] and 1 not in group.actors
