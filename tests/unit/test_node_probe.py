"""The controller's probe of its nodes' raylets (orchestrator.cluster.node_probe), against sockets on
loopback: a listening port is a live raylet, a closed one a gone raylet (proof), a listener whose
accept queue is full never completes a handshake (a host that is down, cut off, or just dropped a
SYN: no proof either way)."""

from __future__ import annotations

import socket
import time

from orchestrator.cluster.node_probe import lost_nodes, refusing


def _listener(backlog: int = 16) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def _closed_port() -> int:
    with _listener() as sock:
        return sock.getsockname()[1]


def test_a_closed_port_is_proof_and_a_listening_raylet_is_not():
    with _listener() as live:
        addresses = {"live": live.getsockname(), "gone": ("127.0.0.1", _closed_port()),
                     "by name": ("localhost", _closed_port())}
        assert refusing(addresses, timeout_s=2.0) == {"gone", "by name"}


def test_trouble_on_this_side_proves_nothing(monkeypatch):
    def no_resolver(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_resolver)
    assert refusing({"gone": ("127.0.0.1", _closed_port())}, timeout_s=0.5) == set()


def test_a_host_that_never_answers_proves_nothing_and_is_given_up_at_the_timeout():
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
            assert refusing({"silent": full.getsockname()}, timeout_s=0.5) == set()
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
