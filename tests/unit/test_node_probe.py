"""The controller's probe of its nodes' raylets (orchestrator.cluster.node_probe), against sockets on
loopback: a listening port is a live raylet, a closed one a gone raylet, a listener whose accept queue
is full never completes a handshake (as a host that is down or cut off)."""

from __future__ import annotations

import socket
import time

from orchestrator.cluster.node_probe import lost_nodes, unreachable


def _listener(backlog: int = 16) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def _closed_port() -> int:
    with _listener() as sock:
        return sock.getsockname()[1]


def test_a_listening_raylet_is_reachable_and_a_closed_port_is_not():
    with _listener() as live:
        addresses = {"live": live.getsockname(), "gone": ("127.0.0.1", _closed_port())}
        assert unreachable(addresses, timeout_s=2.0) == {"gone"}


def test_a_host_that_never_answers_is_unreachable_after_the_timeout_not_before():
    # Linux drops a SYN when the listener's accept queue is full: the handshake never completes.
    with _listener(backlog=0) as full:
        fillers = []
        try:
            for _ in range(4):
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex(full.getsockname())
                fillers.append(client)
            time.sleep(0.2)
            started = time.monotonic()
            assert unreachable({"silent": full.getsockname()}, timeout_s=0.5) == {"silent"}
            assert 0.45 <= time.monotonic() - started < 2.0
        finally:
            for client in fillers:
                client.close()


def test_nodes_the_gcs_lists_dead_or_not_at_all_are_lost_without_a_connection():
    with _listener() as live:
        table = {"alive": live.getsockname(), "dead": None, "refusing": ("127.0.0.1", _closed_port())}
        found = lost_nodes(["alive", "dead", "refusing", "forgotten"], 2.0, raylets=lambda: table)
        assert found == ["dead", "forgotten", "refusing"]
        assert lost_nodes([], raylets=lambda: table) == []


def test_a_gcs_that_does_not_answer_declares_nobody_lost():
    def failing():
        raise ConnectionError("GCS restarting")

    assert lost_nodes(["a", "b"], raylets=failing) == []
