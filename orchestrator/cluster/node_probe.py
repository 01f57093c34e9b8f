"""Whether the nodes a job runs on are still there: the controller's check when ranks fail.

A machine that crashes (power, a kernel panic, a GPU fault that takes the host down) ends
every process on it at once, so no rank is left to send the `node_lost` report of the node
watchdog (orchestrator.rank.actor), and Ray's GCS declares the node dead only after its
health checks time out (3 s x 5 by default). Meanwhile the node's ranks look merely dead or
hung: the release waits on their calls, and their seats, spares included, look usable. So
when a generation fails, the controller asks each node's raylet directly: a TCP connection to
its port (the raylet's gRPC server; the connection is closed at once and carries nothing).
A node whose raylet refuses it (its process gone, the host up) or does not answer within
`timeout_s` (the host gone or cut off) is lost as far as this job is concerned; so is one the
GCS already lists dead, or no longer lists. A live raylet accepts at once, however busy its
process is (the kernel completes the handshake), so a loaded node is not mistaken for a lost
one.

Protocol: the controller's release (orchestrator.controller.recovery) calls `lost_nodes`
once per failure, with the nodes of the job's ranks and spares; controller thread only. Every
connection is started at once, so the call takes at most `timeout_s` however many nodes
there are. When the GCS cannot be asked, nothing is declared lost.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


def gcs_raylets() -> dict[str, tuple[str, int] | None]:
    """`{node id hex: (raylet address, port)}` for every node the GCS knows; None for a dead one."""
    import ray

    return {node["NodeID"]: (node["NodeManagerAddress"], int(node["NodeManagerPort"])) if node["Alive"] else None
            for node in ray.nodes()}


def unreachable(addresses: dict[str, tuple[str, int]], timeout_s: float = PROBE_TIMEOUT_S) -> set[str]:
    """The keys of `addresses` whose (host, port) refuses a TCP connection or does not accept one
    within `timeout_s`; all are tried at once."""
    pending: dict[socket.socket, str] = {}
    failed: set[str] = set()
    with selectors.DefaultSelector() as selector:
        for key, (host, port) in addresses.items():
            try:
                sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                failed.add(key)
                continue
            sock.setblocking(False)
            code = sock.connect_ex((host, port))
            if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                pending[sock] = key
                selector.register(sock, selectors.EVENT_WRITE)
            else:
                failed.add(key)
                sock.close()
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for event, _ in selector.select(left):
                sock = event.fileobj
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    failed.add(pending[sock])
                selector.unregister(sock)
                sock.close()
                del pending[sock]
        failed.update(pending.values())  # no answer in time
        for sock in pending:
            sock.close()
    return failed


def lost_nodes(nodes: Iterable[str], timeout_s: float = PROBE_TIMEOUT_S,
               raylets: Callable[[], dict[str, tuple[str, int] | None]] = gcs_raylets) -> list[str]:
    """Of `nodes` (Ray node ids), those whose raylet is gone: listed dead or unknown by the GCS, or
    not accepting a connection (`unreachable`). Sorted; empty when the GCS does not answer."""
    wanted = sorted(set(nodes))
    if not wanted:
        return []
    try:
        table = raylets()
    except Exception as err:  # the GCS restarting: no evidence either way, so nobody is declared lost
        log.warning("cannot list the cluster's nodes to probe them (%s: %s)", type(err).__name__, err)
        return []
    gone = {node for node in wanted if table.get(node) is None}
    return sorted(gone | unreachable({node: table[node] for node in wanted if node not in gone}, timeout_s))
