"""A parameter-server job's answer to a drain: cut the segment at an exact step, save, move off the node.

Ray drains a node before it goes away (`ray drain-node`, a worker pod's preStop hook running
`undying drain-node`, the autoscaler; orchestrator.cluster.drain). A server there holds its
shard's state: lost with the node, it rolls every server back to the last commit. A worker there
holds none, but its death pauses it. So when a draining node holds actors of the job:
  1. `cut_segment` ends the segment under way at the earliest step every worker can stop at:
     every server holds the pulls it has not answered yet (`freeze`) and says the highest step it
     answered; the cut is the step after the highest; every server then answers the pulls before
     the cut and ends every run at it (`cut`), so each worker stops with the same steps pushed to
     every server: a cut a checkpoint can be saved at (paramserver.shard `check_cut`);
  2. the supervisor saves that cut, as a segment's end;
  3. `move` replaces the actors on the drained nodes: a server by a new one restored from that
     commit, a worker by a new one (it resumes at the cut from the servers' clocks). Ray starts
     nothing on a draining node, so they land elsewhere. Nothing is redone.
A server cannot move without a commit of the cut (no checkpoints, or the save failed): it stays,
and is lost with its node as before; that is said once.

Protocol (the supervisor's thread, paramserver.supervisor): `Moves(draining)`, with the
DrainWatcher's `draining` (orchestrator.cluster.drain: cheap, it asks the GCS at most once a
second); `due(servers, workers)` at each poll of a segment until it says yes: yes when a node
holding actors of the job starts draining (where each runs is asked then), or when their move
is still to be made (the segment that should have made it was rolled back); then
`cut_segment(servers, start, end)`, the save of the cut, `move(...)`, and `uncut(servers)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import ray

log = logging.getLogger(__name__)
ASK_S = 30.0  # how long the actors may take to say where they run


def cut_segment(servers: list, start: int, end: int) -> int:
    """Cut the segment [start, end) at the earliest step every worker can stop at; returns it."""
    answered = ray.get([server.freeze.remote() for server in servers], timeout=ASK_S)
    step = max(start, min(end, max(answered) + 1))
    ray.get([server.cut.remote(step) for server in servers], timeout=ASK_S)
    log.warning("a node with actors of the job is draining: the segment [%d, %d) is cut at step %d", start, end, step)
    return step


def uncut(servers: list) -> None:
    ray.get([server.uncut.remote() for server in servers], timeout=ASK_S)


class Moves:
    def __init__(self, draining: Callable[[], Iterable[str]]):
        self.draining = draining
        self.handled: set[str] = set()  # every drained node seen
        self.nodes: set[str] = set()  # the drained nodes the job's actors have not left yet
        self.servers: list[int] = []  # to move at the cut: indices
        self.workers: list[int] = []

    def due(self, servers: list, workers: list) -> bool:
        """Whether a draining node holds actors of the job (then they are noted for `move`): asked
        when a node starts draining, and again after a segment that should have moved them was
        rolled back instead (the rollback may have replaced some of them)."""
        new = set(self.draining()) - self.handled
        self.handled |= new
        self.nodes |= new
        if not new and not (self.servers or self.workers):
            return False
        where = ray.get([actor.node.remote() for actor in [*servers, *workers]], timeout=ASK_S)
        self.servers = [k for k, node in enumerate(where[:len(servers)]) if node in self.nodes]
        self.workers = [w for w, node in enumerate(where[len(servers):]) if node in self.nodes]
        if not (self.servers or self.workers):
            self.nodes.clear()
        return bool(self.servers or self.workers)

    def move(self, servers: list, workers: list, start_server, start_worker, restore, committed: bool) -> list[str]:
        """Replace the noted actors in place in `servers` / `workers` (their handles), a server only
        when the cut is `committed` (`restore(k, new)` loads it from there); returns what was done,
        a line each."""
        lines, nodes = [], ", ".join(node[:12] for node in sorted(self.nodes))
        for w in self.workers:
            ray.kill(workers[w], no_restart=True)
            workers[w] = start_worker(w)
            lines.append(f"worker {w} moved off draining node(s) {nodes}")
        for k in self.servers:
            if not committed:
                lines.append(f"server {k} stays on draining node(s) {nodes}: the cut was not committed, so a "
                             "new server would have nothing to restore; it is lost with the node")
                continue
            new = start_server(k)
            restore(k, new)
            ray.kill(servers[k], no_restart=True)
            servers[k] = new
            lines.append(f"server {k} moved off draining node(s) {nodes}, restored from the cut")
        self.servers, self.workers = [], []
        self.nodes.clear()
        for line in lines:
            log.warning("%s", line)
        return lines
