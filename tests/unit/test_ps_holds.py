"""The supervisor waits until the servers hold the pulls of a segment's injected faults: a worker's
pull is another caller's call, which Ray may run first, and a pull that passed before its hold was
placed would never fire its fault, with no error. A dead server does not stop the arming (the
supervisor's polls find it)."""

from __future__ import annotations

import types

from ray.exceptions import RayActorError

from paramserver import streams


class _Server:
    def __init__(self, name, dead=False):
        self.name, self.dead = name, dead
        self.hold = types.SimpleNamespace(remote=lambda worker, step: (self, "hold", worker, step))
        self.drop_held = types.SimpleNamespace(remote=lambda worker: (self, "drop", worker))


def test_holds_and_drops_are_waited_for_and_a_dead_server_is_left_to_the_polls(monkeypatch):
    waited = []

    def get(refs, timeout=None):
        waited.append([ref[1:] for ref in refs])
        if any(ref[0].dead for ref in refs):
            raise RayActorError()
        return [None] * len(refs)

    monkeypatch.setattr(streams, "ray", types.SimpleNamespace(get=get))
    servers = [_Server("a"), _Server("b")]
    streams.arm_holds(servers, [(0, 1, 6), (1, 0, 6)])
    streams.drop_holds(servers, 1)
    assert waited == [[("hold", 1, 6), ("hold", 0, 6)], [("drop", 1), ("drop", 1)]]
    servers[1].dead = True
    streams.arm_holds(servers, [(1, 0, 7)])  # no error: the polls find the dead server
