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
