"""The chaos command's "no process left" check sees only the driver's host: rank actors on other
hosts are counted, and a run whose ranks all ran elsewhere skips the check instead of passing it."""

from __future__ import annotations

import os
import socket
import types

import ray

from orchestrator.cli.chaos.runs import RankPidRecorder, RunOutcome


def _actor(hexid: str):
    return types.SimpleNamespace(_actor_id=types.SimpleNamespace(hex=lambda: hexid))


def test_ranks_elsewhere_are_counted_and_a_run_with_none_here_skips_the_check(monkeypatch):
    # Ranks on this host: by hostname (several raylets on one machine) or address (loopback against the
    # interface's on a laptop); a node of another host is elsewhere.
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeID": "here", "NodeManagerAddress": "127.0.0.1", "NodeManagerHostname": "laptop"},
        {"NodeID": "beside", "NodeManagerAddress": "10.0.0.9", "NodeManagerHostname": socket.gethostname()},
        {"NodeID": "there", "NodeManagerAddress": "10.0.0.2", "NodeManagerHostname": "another"}])
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")  # this host's interface
    recorded = []
    recorder = RankPidRecorder(lambda rec: recorded.append((dict(rec.seen), len(rec.elsewhere))))
    recorder.remember(_actor("aa" * 16), {"pid": os.getpid(), "node": "here"})
    recorder.remember(_actor("bb" * 16), {"pid": 4242, "node": "there"})
    recorder.remember(_actor("cc" * 16), {"pid": os.getppid(), "node": "beside"})
    assert list(recorder.seen.values()) == [os.getpid(), os.getppid()] and recorder.elsewhere == {"bb" * 16}
    assert recorded[-1] == (recorder.seen, 1)  # the child writes the count out with the PIDs

    assert RunOutcome(0, None, {}, elsewhere=3).pids_to_check() is None  # nothing here to check: skipped
    assert RunOutcome(0, None, {}, elsewhere=0).pids_to_check() == {}  # no rank at all: checked, trivially
