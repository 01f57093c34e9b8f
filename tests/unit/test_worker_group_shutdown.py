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
