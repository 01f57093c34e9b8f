"""Whether the nodes a job runs on are still there: the controller's check when ranks fail.

When every process on a node ends at once (a kill of the node's processes, a container or
raylet crash that takes its workers along), no rank is left to send the `node_lost` report of
the node watchdog (orchestrator.rank.actor), and Ray's GCS declares the node dead only after
its health checks time out (3 s x 5 by default). Meanwhile the node's ranks look merely dead or
hung: the release waits on their calls, and their seats, spares included, look usable. So when
a generation fails, the controller asks each node's raylet directly: a TCP connection to its
port (the raylet's gRPC server; the connection is closed at once and carries nothing).

Only proof counts, since a node declared lost stays lost for the job: the GCS lists the node
dead or no longer lists it, or the node's host answers that nothing listens on the raylet's port
(connection refused) or that the host is unreachable. A connection that is not answered within
`timeout_s` proves nothing (a dropped SYN is retransmitted only after 1 s; a partition may
heal), nor does an error of the controller's own (no file descriptor, no route): such a node is
left to the paths that existed before (the release timeout kills its stuck ranks; the GCS
declares it dead in time, and new actors in its seats start where Ray re-places them).

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


# What a connection attempt's error proves: the node's raylet is gone (the host says nothing
# listens there) or the host is (an ICMP or ARP answer says it cannot be reached).
PROOF = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH})


def refusing(addresses: dict[str, tuple[str, int]], timeout_s: float = PROBE_TIMEOUT_S) -> set[str]:
    """The keys of `addresses` whose (host, port) refuses a TCP connection or whose host is
    unreachable (`PROOF`), tried all at once for up to `timeout_s`. No answer in time, or an error
    of this side's (a socket that cannot be made, a name that does not resolve), proves nothing."""
    pending: dict[socket.socket, str] = {}
    proven: set[str] = set()
    with selectors.DefaultSelector() as selector:
        for key, (host, port) in addresses.items():
            code = _connect(host, port, pending, key, selector)
            if code in PROOF:
                proven.add(key)
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for event, _ in selector.select(left):
                sock = event.fileobj
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in PROOF:
                    proven.add(pending[sock])
                selector.unregister(sock)
                sock.close()
                del pending[sock]
        for sock in pending:  # no answer in time: no verdict
            sock.close()
    return proven


def _connect(host: str, port: int, pending: dict, key: str, selector) -> int:
    """Start a non-blocking connection to (host, port); a started one joins `pending` (and the
    selector), otherwise its socket is closed. Returns the errno of a connection that failed at
    once (0 when started or made)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # a name that does not resolve, no descriptor left: this side's trouble
        return 0
    sock.setblocking(False)
    code = sock.connect_ex(address)
    if code in (0, errno.EINPROGRESS):
        pending[sock] = key
        selector.register(sock, selectors.EVENT_WRITE)
        return 0
    sock.close()
    return code


def lost_nodes(nodes: Iterable[str], timeout_s: float = PROBE_TIMEOUT_S,
               raylets: Callable[[], dict[str, tuple[str, int] | None]] = gcs_raylets) -> list[str]:
    """Of `nodes` (Ray node ids), those proven gone: listed dead or unknown by the GCS, or refusing
    a connection to their raylet (`refusing`). Sorted; empty when the GCS does not answer."""
    wanted = sorted(set(nodes))
    if not wanted:
        return []
    try:
        table = raylets()
    except Exception as err:  # the GCS restarting: no evidence either way, so nobody is declared lost
        log.warning("cannot list the cluster's nodes to probe them (%s: %s)", type(err).__name__, err)
        return []
    gone = {node for node in wanted if table.get(node) is None}
    return sorted(gone | refusing({node: table[node] for node in wanted if node not in gone}, timeout_s))
