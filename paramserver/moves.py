"""A parameter-server job's answer to a drain: cut the segment at an exact step, save, move off the node.

Ray drains a node before it goes away (`ray drain-node`, a worker pod's preStop hook running
`undying drain-node`, the autoscaler; orchestrator.cluster.drain). A server there holds its
shard's state: lost with the node, it rolls every server back to the last commit. A worker there
holds none, but its death pauses it. So when a draining node holds actors of the job:
  1. `cut_segment` ends the segment under way at the earliest step every worker can stop at:
     every server holds the pulls it has not answered yet (`freeze`) and says the highest step it
     answered; the cut is the step after the highest; every server then answers the pulls before
     the cut and ends every run at it (`cut`), so each worker stops with the same steps pushed to
     every server: a cut a checkpoint can be saved at (paramserver.shard `check_cut`). With asp a
     fast worker may have pulled its segment's last step already: the cut is then the segment's end;
  2. the supervisor saves that cut, as a segment's end;
  3. `finish` replaces the actors on the drained nodes: a server by a new one restored from that
     commit, a worker by a new one (it resumes at the cut from the servers' clocks). Ray starts
     nothing on a draining node, so they land elsewhere. Nothing is redone.
A server cannot move without a commit of the cut (no checkpoints, or the save failed), nor when
its replacement does not start within START_S (no seat off the node) or does not restore: it
stays, and is lost with its node as before; that is said. The move is booked as re-formation.
Nothing moves when the job is ending anyway (its last step, or a signal).

Protocol (the supervisor's thread, paramserver.supervisor): `Moves(draining)`, with the
DrainWatcher's `draining` (orchestrator.cluster.drain: cheap, it asks the GCS at most once a
second); `check(supervisor, start, end)` at each poll of a segment: it sets `supervisor.cut` when
it cut the segment, and returns a reason to roll back when a server failed the cut (a rollback's
abort and reopen undo a freeze and a cut); after the segment, the save of the cut, then
`finish(supervisor, cut)`. A signal's stop cuts the segment the same way: `signal_cut(supervisor,
start, end, streams)` at each poll after a signal (paramserver.preemption says when it gives up the
cut and stops the segment where it is).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from paramserver import checkpoint
from paramserver import recovery as book  # the goodput buckets

log = logging.getLogger(__name__)
ASK_S = 10.0  # how long the actors may take to answer a drain's calls
# How long a moved server may take to start: Ray places it off the draining node, and on a full
# cluster it may find no seat; past this the server stays (and is lost with the node, as before).
START_S = 60.0
GONE = (RayActorError, GetTimeoutError)  # an actor that died or does not answer: its failure path handles it


def cut_segment(servers: list, start: int, end: int, why: str, timeout_s: float = ASK_S) -> int:
    """Cut the segment [start, end) at the earliest step every worker can stop at; returns it.
    Raises GONE's errors when a server fails either call or does not answer within `timeout_s`
    (each); a rollback's abort and reopen undo what the others took."""
    answered = ray.get([server.freeze.remote() for server in servers], timeout=timeout_s)
    step = max(start, min(end, max(answered) + 1))
    ray.get([server.cut.remote(step) for server in servers], timeout=timeout_s)
    log.warning("%s: the segment [%d, %d) is cut at step %d", why, start, end, step)
    return step


def where(actors: list) -> list[str | None]:
    """The node of each actor; None for one that is dead or does not answer within ASK_S (still
    waiting for resources, say: then not on a draining node, where Ray starts nothing)."""
    refs = [actor.node.remote() for actor in actors]
    ray.wait(refs, num_returns=len(refs), timeout=ASK_S)
    nodes = []
    for ref in refs:
        try:
            nodes.append(ray.get(ref, timeout=0))
        except (*GONE, RayTaskError):
            nodes.append(None)
    return nodes


class Moves:
    def __init__(self, draining: Callable[[], Iterable[str]]):
        self.draining = draining
        self.handled: set[str] = set()  # every drained node seen
        self.nodes: set[str] = set()  # the drained nodes the job's actors have not left yet
        self.servers: list[int] = []  # to move at the cut: indices
        self.workers: list[int] = []

    def due(self, servers: list, workers: list) -> bool:
        """Whether a draining node holds actors of the job (then they are noted for `finish`): asked
        when a node starts draining, and again after a segment that should have moved them was
        rolled back instead (the rollback may have replaced some of them)."""
        new = set(self.draining()) - self.handled
        self.handled |= new
        self.nodes |= new
        if not new and not (self.servers or self.workers):
            return False
        nodes = where([*servers, *workers])
        self.servers = [k for k, node in enumerate(nodes[:len(servers)]) if node in self.nodes]
        self.workers = [w for w, node in enumerate(nodes[len(servers):]) if node in self.nodes]
        if not (self.servers or self.workers):
            self.nodes.clear()
        return bool(self.servers or self.workers)

    def check(self, sup, start: int, end: int) -> str | None:
        """At a poll of segment [start, end): cut it when a draining node holds actors of the job."""
        if sup.cut is not None or not self.due(sup.servers, sup.workers):
            return None
        try:
            sup.cut = cut_segment(sup.servers, start, end, "a node with actors of the job is draining")
        except GONE as err:
            return f"a server failed the drain's cut ({type(err).__name__})"
        sup.held_calls.clear()  # answers from before the cut may name holds it dropped
        return None

    def finish(self, sup, cut: int) -> None:
        """After the save of `cut`: replace the noted actors (their handles in the supervisor's lists),
        a server only when `cut` is committed, unless the job ends there anyway; then every server
        takes pulls again."""
        if cut >= sup.steps or (sup.ckpt.preemption is not None and sup.ckpt.preemption.signals):
            return
        nodes = ", ".join(node[:12] for node in sorted(self.nodes))
        sup.ledger.enter(book.REFORMATION)  # the cut is saved: moving the actors re-forms the job
        lines = []
        for w in self.workers:
            ray.kill(sup.workers[w], no_restart=True)
            sup.workers[w] = sup.new_worker(w)
            lines.append(f"worker {w} moved off draining node(s) {nodes}")
        lines += [self._move_server(sup, k, cut, nodes) for k in self.servers]
        self.servers, self.workers = [], []
        self.nodes.clear()
        for line in lines:
            log.warning("%s", line)
        sup.moved += lines
        # Answered before the next segment's pulls reach a server, which the cut would refuse; a dead
        # or silent server is found by the next segment's progress polls.
        with contextlib.suppress(*GONE):
            ray.get([server.uncut.remote() for server in sup.servers], timeout=ASK_S)

    @staticmethod
    def _move_server(sup, k: int, cut: int, nodes: str) -> str:
        """Server `k` replaced by a new one restored from the commit of `cut`; the line that says so,
        or why it stays."""
        if cut != sup.last_commit():
            return (f"server {k} stays on draining node(s) {nodes}: the cut was not committed, so a new server "
                    "would have nothing to restore; it is lost with the node")
        new = sup.actors.start_server(k)
        try:
            ray.get(new.progress.remote(), timeout=START_S)  # placed and up: the restore's calls have no limit
            checkpoint.restore_servers([new], sup.ckpt.root, cut, storage_options=sup.ckpt.storage_options,
                                       read_retry_s=sup.ckpt.read_retry_s, timeout=sup.ckpt.restore_timeout)
            ray.get(new.reopen.remote(cut), timeout=ASK_S)
        except BaseException as err:  # any failure to restore: the old server is still whole
            ray.kill(new, no_restart=True)  # and a second signal's Preempted must not leave it running
            if not isinstance(err, Exception):
                raise
            return (f"server {k} stays on draining node(s) {nodes}: its replacement did not start or restore "
                    f"({type(err).__name__}: {err}); it is lost with the node")
        ray.kill(sup.servers[k], no_restart=True)
        sup.servers[k] = new
        return f"server {k} moved off draining node(s) {nodes}, restored from the cut"


def signal_cut(sup, start: int, end: int, streams: dict) -> None:
    """After a signal, at each poll of the supervisor `sup` in segment [start, end): cut the segment
    where every worker can stop (its run() saves the cut and stops there; the job's last segment runs
    on), while that still fits in the grace; else, or when a server does not take the cut in time,
    stop where it is (steps redone) and raise Preempted."""
    preemption, failed = sup.ckpt.preemption, False
    if sup.cut is None and end < sup.steps and not preemption.cut_now():
        try:
            sup.cut = cut_segment(sup.servers, start, end, "a signal", max(0.1, preemption.slack_s() / 2))
            sup.held_calls.clear()  # answers from before the cut may name holds it dropped
        except GONE:
            failed = True
    if failed or preemption.cut_now():
        for server in sup.servers:
            server.abort.remote()  # its waiting pulls fail, so every worker's run ends
        sup.stop_streams(streams, within_s=preemption.left_s())
        raise preemption.preempted(sup.last_commit(), saved_now=False)
