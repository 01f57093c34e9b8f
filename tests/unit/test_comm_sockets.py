"""What a rank's abort shuts down: the TCP sockets opened while its process groups formed, never a
Unix socket opened meanwhile by another thread (Ray's own), nor a later socket that reused the
number of one the group had already closed."""

from __future__ import annotations

import socket

from orchestrator.rank.comm_abort import CommSockets


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def _is_shut(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""  # shut down for reading: end of stream at once
    except BlockingIOError:
        return False


def test_abort_shuts_the_group_s_tcp_sockets_only():
    sockets = CommSockets()
    with sockets.adding():
        group, peer = _tcp_pair()
        ray_unix, ray_other = socket.socketpair()  # another thread's, in the same window
    gone_fd = peer.fileno()
    peer.close()  # the group closes one of its own ...
    reused = socket.socket()  # ... and a later socket takes its number (the lowest free one)
    with socket.create_server(("127.0.0.1", 0)) as server:
        reused.connect(server.getsockname())
        accepted, _ = server.accept()
    try:
        assert reused.fileno() == gone_fd
        assert sockets.abort() == 1
        assert _is_shut(group) and not _is_shut(ray_unix) and not _is_shut(reused)
    finally:
        for sock in (group, ray_unix, ray_other, reused, accepted):
            sock.close()


def _left_during(actor, work, after_s: float) -> dict:
    """Run `work` on a thread and `actor.leave()` after `after_s`: the error that ended it, and when."""
    import threading
    import time

    ended = {}

    def run() -> None:
        began = time.monotonic()
        try:
            work()
        except Exception as err:  # noqa: BLE001 (the aborted socket's error, whichever torch raises)
            ended["error"] = type(err).__name__
        ended["after_s"] = time.monotonic() - began

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(after_s)
    actor.leave()
    thread.join(15)
    return ended


def _actor():
    """A rank actor's join and leave, without Ray (its constructor would connect to one)."""
    import threading

    from tests.unit.test_restore_turns import rank_actor

    actor = rank_actor()
    actor.sockets, actor._abort = None, threading.Event()
    return actor


def test_leaving_ends_a_wait_in_the_groups_store_at_once(tmp_path):
    # A mesh's sub-group forms through the group's store, waiting there for every member; a peer that
    # never builds leaves it waiting for the collective timeout, holding the rank's next restore.
    # `leave` aborts the group's sockets, its store client's among them: the wait ends at once.
    from datetime import timedelta

    import torch.distributed as dist

    from orchestrator.wire.store import RendezvousServer

    server, actor = RendezvousServer("127.0.0.1"), _actor()
    actor.join(0, 0, 1, server.address, timeout_s=30.0, collective_timeout_s=30.0)
    store = dist.distributed_c10d._get_default_store()
    ended = _left_during(actor, lambda: store.wait(["a-member-that-never-registers"], timedelta(seconds=30)), 0.5)
    assert "error" in ended and ended["after_s"] < 5, ended


def test_a_second_abort_waits_for_the_first_to_finish(monkeypatch):
    # The training thread's teardown must not destroy the groups while the watcher is aborting them.
    import threading
    import time

    import orchestrator.rank.comm_abort as comm_abort

    monkeypatch.setattr(comm_abort, "_abort_nccl", lambda: time.sleep(0.5))  # an abort under way
    sockets, ended = CommSockets(), {}
    first = threading.Thread(target=lambda: ended.setdefault("first", (sockets.abort(), time.monotonic())))
    first.start()
    time.sleep(0.1)
    sockets.abort()
    ended["second"] = time.monotonic()
    first.join(5)
    assert ended["second"] >= ended["first"][1]


def test_an_abort_leaks_no_copy_of_a_descriptor_now_held_by_something_else():
    import os

    sockets = CommSockets()
    with sockets.adding():
        group, peer = _tcp_pair()
    number = group.fileno()
    group.close()  # the group closed its own socket ...
    read_end, write_end = os.pipe()  # ... and a pipe took the number (the lowest free one)
    try:
        assert number in (read_end, write_end)  # the lowest free number
        before = len(os.listdir("/proc/self/fd"))
        assert sockets.abort() == 1  # the group's other end, still open; the pipe left alone
        assert len(os.listdir("/proc/self/fd")) == before  # its copy closed: a reader still sees end of file
    finally:
        os.close(read_end)
        os.close(write_end)
        peer.close()


def test_leaving_ends_a_join_waiting_for_a_peer_that_never_comes():
    # A peer died during the rendezvous: the survivors' init_process_group waits in the group's store for
    # it. `leave` (the controller's release) must end that wait at once, not at the store's timeout, or
    # the rank's next join would run beside the stale one in the same process.
    from orchestrator.wire.store import RendezvousServer

    server, actor = RendezvousServer("127.0.0.1"), _actor()
    ended = _left_during(actor, lambda: actor.join(0, 0, 2, server.address, timeout_s=30.0,
                                                   collective_timeout_s=30.0), 1.0)  # rank 1 never joins
    assert "error" in ended and ended["after_s"] < 6, ended


def test_a_release_that_comes_while_a_join_still_connects_ends_that_join(monkeypatch):
    # Before the group's capture exists a `leave` has no socket to shut: the join finds it released
    # itself before it forms the group, rather than wait the collective timeout for a dead peer.
    import time

    import pytest

    from orchestrator.rank import actor as rank_actor_module
    from orchestrator.wire.store import RendezvousServer

    server, actor = RendezvousServer("127.0.0.1"), _actor()
    real, calls = rank_actor_module.connect, []

    def connecting(*args, **kwargs):
        calls.append(args)
        if len(calls) == 4:  # the snapshot writer's client, the last before the group's capture
            actor.leave()
        return real(*args, **kwargs)

    monkeypatch.setattr(rank_actor_module, "connect", connecting)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 was released while it joined generation 0"):
        actor.join(0, 0, 2, server.address, timeout_s=30.0, collective_timeout_s=10.0)
    assert time.monotonic() - began < 5
