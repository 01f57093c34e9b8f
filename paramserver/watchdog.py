"""The hang watchdog's Ray side: probes the suspect workers, kills the hung ones.

At the job's start, `first_answers(servers, workers)` waits at most the first-step limit for every
actor's first answer (ActorsNotStarted names those that never gave one).

Called by the supervisor's loop (paramserver.supervisor) every poll of a segment, after it took
the streams and polled the servers: `poll(workers, servers_asked_at)` answers the probes that came
back, sends new ones (a worker actor's `pid`, answered by its second thread while its run holds the
first) and kills each worker the watch (paramserver.hang_watch) finds hung, unless a server is slow
to answer (a stopped server silences every worker, and is killed at its own limit instead). A
killed worker's stream then ends as a dead actor's, and the supervisor replaces it as it replaces
any dead worker, asking `take(w)` for the hang (when it began, and why) to book and report.
Before that, the supervisor asks `server_hung(k, server, asked_at)` for each of its progress calls
still outstanding (a server in `unanswered`, a new actor that answered none yet, gets the first-step
limit): a server whose call is outstanding for the hang limit is killed, and the
supervisor rolls back as for a dead server, reading `hung_servers` (since when, and why) to book
and report.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from paramserver.hang_watch import HangLimits, HangWatch

log = logging.getLogger(__name__)
SERVER_SLOW_S = 2.0  # a server whose progress call is outstanding this long: no worker is blamed meanwhile


class ActorsNotStarted(RuntimeError):
    """Servers or workers that did not answer their first call within elastic.first_step_timeout_s."""


class Watchdog:
    def __init__(self, limits: HangLimits, clock: Callable[[], float] = time.time):
        self.watch = HangWatch(limits, clock)
        self._probes: dict[int, object] = {}  # worker -> its outstanding probe
        self._hangs: dict[int, tuple[float, str]] = {}  # worker killed as hung -> (silent since, why)
        self.hung_servers: dict[int, tuple[float, str]] = {}  # server killed as hung -> (silent since, why)
        self.unanswered: set[int] = set()  # servers whose new actor has answered no progress call yet

    def poll(self, workers: list, servers_asked_at: float) -> None:
        """`servers_asked_at`: when the oldest of the supervisor's outstanding progress calls was sent."""
        for w, probe in list(self._probes.items()):
            if ray.wait([probe], timeout=0)[0]:
                del self._probes[w]
                with contextlib.suppress(RayActorError):
                    ray.get(probe)
                    self.watch.probe_answered(w)
        for w in self.watch.to_probe():
            self._probes[w] = workers[w].pid.remote()
        if self.watch.clock() - servers_asked_at >= min(SERVER_SLOW_S, self.watch.steady_s() / 2):
            return  # every worker waits on a server that does not answer: the server is to blame, at its limit
        for w, why in self.watch.hung_workers():
            log.warning("%s: killing it; it is replaced as a dead worker is", why)
            self._hangs[w] = (self.watch.silent_since(w), why)
            self._probes.pop(w, None)
            self.watch.ended(w)  # its stream ends with the kill
            ray.kill(workers[w], no_restart=True)

    def server_hung(self, k: int, server, asked_at: float) -> bool:
        """Kill server `k` (its handle `server`) when its progress call, outstanding since `asked_at`,
        is past the hang limit; whether it did."""
        why = self.watch.server_hung(asked_at, started=k in self.unanswered)
        if why is None:
            return False
        log.warning("server %d %s: killing it", k, why)
        self.hung_servers[k] = (asked_at, f"server {k} {why}")
        ray.kill(server, no_restart=True)
        return True

    def first_answers(self, servers: list, workers: list) -> tuple[list, list]:
        """The job's start (the supervisor's, before anything else): each server's first `progress`
        answer and each worker's PID, the actors given elastic.first_step_timeout_s together to be
        placed and built. ActorsNotStarted names the ones that were not (a cluster whose CPUs something
        else holds, a constructor stuck on its storage), rather than the job waiting without a word."""
        refs = [server.progress.remote() for server in servers] + [worker.pid.remote() for worker in workers]
        limit = self.watch.limits.first_step_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=limit)
        if len(ready) < len(refs):
            answered = set(ready)
            late = [f"server {k}" for k, ref in enumerate(refs[:len(servers)]) if ref not in answered] + \
                [f"worker {w}" for w, ref in enumerate(refs[len(servers):]) if ref not in answered]
            raise ActorsNotStarted(f"{', '.join(late)} did not start within {limit:g} s "
                                   "(elastic.first_step_timeout_s): `ray status` shows whether the cluster has a "
                                   f"free CPU for each of the job's {len(refs)} actors (another job may hold them); "
                                   "a slow start (weights read from a far store) needs a larger limit")
        answers = ray.get(refs)
        return answers[:len(servers)], answers[len(servers):]

    def take(self, w: int) -> tuple[float, str] | None:
        """(silent since, why) when the supervisor killed worker `w` as hung; forgotten once taken."""
        return self._hangs.pop(w, None)

    def forget(self) -> None:
        """A segment starts, or stopped (a rollback): the probes and kills before are settled."""
        self._probes.clear()
        self._hangs.clear()
        self.hung_servers.clear()
