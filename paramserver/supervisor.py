"""The supervisor of a parameter-server job: runs it in segments between checkpoints and repairs it the PS way.

Called by paramserver.job.run_ps on the driver (after ray.init): `Supervisor(...).run()`, then
`teardown()` (run_ps reads the servers' final stats between). It owns the actors (started through
`Actors`, which binds the shard plan and the configs). Per segment [a, b) (b: the next multiple
of checkpoint every_steps, or train.steps; paramserver.recovery.segment_end):
  1. arm the injected worker kills of the segment as holds on server 0's pulls (paramserver.gate);
  2. start every worker's `run(servers, a, b)`, a stream of StepLogs, and watch the streams, the
     servers' progress (version, clocks) and the holds every POLL_S until every stream ends:
     * a worker's actor dies: a new WorkerActor of the same index resumes at the clock every
       server records for it (each push is acknowledged before the next pull, so it is exact) and
       runs to b; the other workers keep running: no global restart. In bsp the final model is bit
       for bit the failure-free run's (the replacement computes the same gradients on the same
       version). When the servers disagree on that clock (it died between one step's pushes to two
       servers) the step cannot be replayed exactly, and the segment is rolled back as below;
     * a server dies (its progress call fails; an injected kill_server fires once every worker has
       pushed at_step steps to it) or a worker's run fails: the segment stops (every live server is
       aborted, so waiting pulls fail; every stream ends), a new ServerActor takes the dead shard,
       and EVERY server is restored from the last committed checkpoint, or to the initial values
       when none is committed; the segment reruns from there with the same workers;
  3. with checkpoints: save a PS checkpoint at b (paramserver.checkpoint; every server at the cut b).
A worker or a server that hangs instead of dying (stopped, deadlocked) is killed by the hang
watchdog (paramserver.watchdog: no step, or no answer to a progress call, for the limits of
`elastic.hang_timeout_s`, `elastic.first_step_timeout_s`, which bounds the actors' start too) and repaired.
A drain of a node with actors of the job cuts the segment short at an exact step, saved, where they
move off it (paramserver.moves). A lost owner lease (`Checkpoints.owner`, ckpt.ownership) ends the
job at the next poll with OwnershipLost, writing nothing there after; a signal (`Checkpoints.preemption`)
ends it with Preempted at a saved cut, or where it is when that no longer fits (paramserver.preemption).
The goodput ledger books the wall (paramserver.recovery's buckets); `failures` says what happened.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ckpt.failed_saves import FailedSaves
from ckpt.ownership import OwnershipLost
from ckpt.reshard import interval_union
from paramserver import checkpoint, restores
from paramserver import recovery as book  # the goodput buckets
from paramserver.actor_pids import ActorPids
from paramserver.actors import ServerStats, StepLog
from paramserver.hang_watch import HangLimits
from paramserver.job_inputs import Actors, Checkpoints
from paramserver.moves import Moves, signal_cut
from paramserver.recovery import (
    Failure,
    Fault,
    FaultPlan,
    Ledger,
    NullLedger,
    record_rollback,
    resume_step,
    segment_end,
)
from paramserver.restart_budget import RestartBudget
from paramserver.shard import NotAtCut
from paramserver.step_logs import StepLogs
from paramserver.streams import actor_died, arm_holds, brief, dead_servers, drop_holds, fire_held, stop_all, take
from paramserver.update_history import UpdateHistory
from paramserver.watchdog import Watchdog

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often the supervisor looks at the streams, the servers and the holds
STOP_S = 120.0  # a worker that has not stopped this long after the servers were aborted is killed
MAX_REPLACEMENTS = 3  # a worker replaced this often with no step landing (it cannot start) rolls back


class Supervisor:
    def __init__(self, actors: Actors, servers: int, workers: int, steps: int, *,
                 checkpoints: Checkpoints | None = None, faults: list[Fault] | tuple[Fault, ...] = (),
                 ledger: Ledger | None = None, on_stats: Callable[[list[ServerStats]], None] | None = None,
                 stats_every_s: float = 1.0, on_step: Callable[[StepLog], None] | None = None,
                 hang: HangLimits | None = None, budget: RestartBudget | None = None,
                 on_failure: Callable[[Failure], None] | None = None):
        self.actors, self.steps, self.ckpt = actors, steps, checkpoints
        self.on_failure = on_failure  # each failure as it is booked (run_ps's `on_failure`: the driver's metrics)
        self.watchdog = Watchdog(hang or HangLimits(), clock=lambda: time.time())  # an actor hung, not dead
        self.budget = budget or RestartBudget()  # the repairs the job may make (elastic.max_restarts)
        self.on_step = on_step  # each worker step's log as it arrives (run_ps's `on_step`)
        self.plan, self.ledger = FaultPlan(faults), ledger or NullLedger()
        # Without checkpoints a rollback restarts the job from step 0: any record may be folded.
        self.history = UpdateHistory(on_stats, foldable_below=0 if checkpoints else math.inf)
        self.stats_every_s = stats_every_s
        self.servers = [self.new_server(k) for k in range(servers)]
        self.workers = [self.new_worker(w) for w in range(workers)]
        # (worker, step) -> the surviving execution's log, the oldest folded past step_logs.KEEP
        self.logs = StepLogs(workers, foldable_below=0 if checkpoints else math.inf)
        self.failures, self.saved = [], []  # what failed (Failure); the checkpoint steps this run committed
        self.save_streak = FailedSaves(checkpoints.max_failed_saves if checkpoints else 1)
        self.skipped: set[int] = set()  # commits a server could not read, kept: never restored, nor saved over
        self.unsure: set[int] = set()  # saves whose manifest create failed unsure (ckpt.commit.Committer.unsure)
        self.pids = ActorPids()  # every actor process this job started, by label; the live one of each
        self.start_step, self.redone = 0, 0  # the step resumed from; step executions thrown away by rollbacks
        self._kills: dict[tuple[str, int], float] = {}  # (kind, index) -> when the supervisor killed it
        self._pauses: dict[int, Failure] = {}  # worker -> its replacement, until the first push lands
        self._dead_workers: set[int] = set()
        self._replaced: dict[int, int] = {}  # worker -> replacements since a step of its last landed
        self.held_calls: dict[int, object] = {}  # server -> its outstanding `held` call
        self.starts = book.SegmentStarts()  # the productive total at each segment's start (lost work)
        self._paused: list[tuple[float, float]] = []  # the worker pauses booked, merged: overlaps book once
        self.moves = Moves(checkpoints.draining) if checkpoints and checkpoints.draining else None
        self.cut: int | None = None  # where the segment under way was cut short (a drain or a signal)
        self.moved: list[str] = []  # what the drains moved, a line each

    # ---- the job ----

    def run(self) -> None:
        answers, pids = self.watchdog.first_answers(self.servers, self.workers)
        for answer in answers:
            self.pids.note("server", answer.server, answer.pid)
            self.watchdog.unanswered.discard(answer.server)
        for w, pid in enumerate(pids):
            self.pids.note("worker", w, pid)
        step = self.start_step = restores.resume(self)
        if self.ckpt is not None and self.ckpt.on_resumed is not None:
            self.ckpt.on_resumed(step)
        if self.ckpt is not None and self.ckpt.on_training is not None:
            self.ckpt.on_training()
        while step < self.steps:
            end = segment_end(step, self.steps, self.ckpt.every_steps if self.ckpt else None)
            restored = self._segment(step, end)
            cut, self.cut = self.cut, None
            end = end if cut is None else cut
            if restored is None and end != step:  # a cut at the start: committed already, or nothing trained
                restored = self._save(step, end)
            if restored is None and cut is not None and self.moves is not None:
                self.moves.finish(self, end)  # a drain's cut (a signal's too: then nothing moves)
            if restored is not None:
                self.budget.rolled_back(step, self.failures[-1])
                step = restored
                continue
            self.budget.segment_done()
            step = end
            if self.ckpt and self.ckpt.preemption and self.ckpt.preemption.signals and end < self.steps:
                raise self.ckpt.preemption.preempted(self.last_commit(), saved_now=end == self.last_commit())
        self.ledger.enter(book.OTHER)

    def _save(self, start: int, end: int) -> int | None:
        """Commit the cut `end`; a server that dies meanwhile rolls the segment back (its step)."""
        if self.ckpt is None:
            self.history.poll(self.servers)
            return None
        self.ledger.enter(book.SAVE)
        try:
            # Every update before the cut, before a server can be lost after it (one that does not answer
            # rolls the segment back, as a dead one: the rollback finds and replaces it).
            self.history.drain(self.servers, self.ckpt.save_timeout[0] if self.ckpt.save_timeout else None)
            commit = checkpoint.save_ps_checkpoint(self.servers, self.ckpt.root, end, job=self.ckpt.job,
                                                   storage_options=self.ckpt.storage_options, owner=self.ckpt.owner,
                                                   state={"goodput": self.ledger.totals()},
                                                   timeout=self.ckpt.save_timeout, skipped=self.skipped,
                                                   unsure=self.unsure)
            self.saved.append(end)  # committed (now or before): a rollback from here on resumes at it
            self.save_streak.committed()
            self.history.committed(end)
            self.logs.committed(end)
            if commit is not None and self.ckpt.on_commit is not None:
                self.ckpt.on_commit(commit)
        except (RayActorError, NotAtCut, GetTimeoutError) as err:  # (NotAtCut through Ray: a RayTaskError that is one)
            if self.saved and self.saved[-1] == end == self.steps:  # the final step is committed: done
                return None
            why = ("a server died during the checkpoint save" if isinstance(err, RayActorError) else
                   "a server did not answer before the checkpoint save" if isinstance(err, GetTimeoutError) else
                   brief(err))
            return self._rollback(start, {}, set(), why, self.starts.current)
        except checkpoint.PSCheckpointError as err:  # the job goes on (a rollback goes to an older commit)
            # Training goes on, unless it was the final save or too many failed in a row (SavesFailing).
            count = self.save_streak.failed(end, err, final=end == self.steps)
            log.warning("checkpoint step %d was not committed (%s); training goes on and the next save commits (%s)",
                        end, err, count)
        return None

    def last_commit(self) -> int | None:
        return self.saved[-1] if self.saved else (self.start_step or None)  # this run's, or the one resumed

    def teardown(self) -> None:
        for actor in self.workers + self.servers:
            ray.kill(actor, no_restart=True)

    # ---- one segment ----

    def _segment(self, start: int, end: int) -> int | None:
        """Run [start, end); None once every worker finished it, else the step it was rolled back to."""
        self.ledger.enter(book.PRODUCTIVE)
        productive_at_start = self.starts.begin(start, self.ledger.totals().get(book.PRODUCTIVE, 0.0))
        self._arm(start, end)
        self.watchdog.forget()  # a kill of the segment before that raced its stream's end
        streams = {w: self._launch(w, start, end) for w in range(len(self.workers))}
        progress = {k: (s.progress.remote(), time.time()) for k, s in enumerate(self.servers)}
        stats_due = time.time() + self.stats_every_s
        while streams:
            ray.wait(list(streams.values()), num_returns=1, timeout=POLL_S)
            if self.ckpt is not None and self.ckpt.owner is not None and self.ckpt.owner.lost is not None:
                raise OwnershipLost(self.ckpt.owner.lost)  # another driver took the root: train no further
            if self.ckpt is not None and self.ckpt.preemption is not None and self.ckpt.preemption.signals:
                signal_cut(self, start, end, streams)
            # A drain cuts the segment short (self.cut): every run ends there, then it is saved and moved.
            trouble = (self.moves and self.moves.check(self, start, end)) or self._take_streams(streams, start, end)
            dead = self._poll_servers(progress, start, end)
            if trouble or dead:
                why = trouble or "; ".join(w for _, w in self.watchdog.hung_servers.values()) or "a server died"
                return self._rollback(start, streams, dead, why, productive_at_start)
            # A hung worker is killed (its stream ends next poll, and it is replaced); none is blamed
            # while a server is slow to answer (its silence may be that server's).
            self.watchdog.poll(self.workers, min(asked_at for _, asked_at in progress.values()))
            self.history.answered()
            if time.time() >= stats_due:  # asked without waiting: a stopped server must not hold this loop
                stats_due = time.time() + self.stats_every_s
                self.history.ask(self.servers)
        return None

    def new_server(self, k: int):
        """A new actor for server `k` (it builds its shard: the watchdog's first-step limit)."""
        self.watchdog.unanswered.add(k)
        return self.actors.start_server(k)

    def new_worker(self, w: int):
        """A new actor for worker `w` (its first step builds it: the watchdog's first-step limit)."""
        self.watchdog.watch.started(w)
        return self.actors.start_worker(w)

    def _launch(self, w: int, start: int, end: int):
        self.watchdog.watch.launched(w, start)
        return self.workers[w].run.remote(self.servers, start, end, self.actors.slow.get(w, 0.0))

    def _arm(self, start: int, end: int) -> None:
        arm_holds(self.servers, self.plan.holds(start, end, len(self.workers)))

    def _take_streams(self, streams: dict, start: int, end: int) -> str | None:
        """Take every finished step's log; replace a dead worker. A reason to roll back, or None."""
        for w, stream in list(streams.items()):
            logs, error, ended = take(stream)
            for entry in logs:
                self._on_log(entry)
            if not ended:
                continue
            del streams[w]
            self.watchdog.watch.ended(w)
            self._close_pause(w, time.time())
            if error is None:
                continue
            if not actor_died(error):
                return f"worker {w}'s run failed: {brief(error)}"
            self._dead_workers.add(w)
            if (tries := self._replaced.get(w, 0)) >= MAX_REPLACEMENTS:  # a rollback's reason: the crash loop bounds it
                return f"worker {w} was replaced {tries} times and died before a step: {brief(error)}"
            self._replaced[w] = tries + 1
            stream = self._replace_worker(w, start, end)
            if stream is None:
                return f"worker {w} died and could not resume alone"
            streams[w] = stream
        return None

    def _on_log(self, entry: StepLog) -> None:
        self.logs.add(entry)
        self.watchdog.watch.landed(entry.worker, entry.step, entry.finished_at)
        self._replaced.pop(entry.worker, None)
        self.pids.note("worker", entry.worker, entry.pid)
        failure = self._pauses.pop(entry.worker, None)
        if failure is not None:  # booked before `on_step`: a step that ends a pause reports it measured
            failure.pids["new"] = entry.pid
            self._book_pause(failure, entry.finished_at)
        if self.on_step is not None:
            self.on_step(entry)

    def _close_pause(self, w: int, now: float) -> None:
        failure = self._pauses.pop(w, None)
        if failure is not None:  # the replacement had no step left to run, or the segment stopped
            self._book_pause(failure, now)

    def _book_pause(self, failure: Failure, resumed: float) -> None:
        """`failure`'s pause, its own whole; the ledger books only what no other pause booked (two workers
        of a lost node replaced together pause the job once, not twice), in whatever order they end."""
        start = failure.detected_at
        failure.pause_s = max(0.0, resumed - start)
        covered = sum(max(0.0, min(resumed, end) - max(start, begin)) for begin, end in self._paused)
        self.ledger.move(max(0.0, failure.pause_s - covered), book.PRODUCTIVE, book.REFORMATION)
        self._paused = interval_union([*self._paused, (start, resumed)])

    def _replace_worker(self, w: int, start: int, end: int):
        """A new actor for dead worker `w`, resumed where the servers have it; None when it cannot be."""
        detected, injected, hang = time.time(), self._kills.pop(("worker", w), None), self.watchdog.take(w)
        try:
            clocks = [p.clocks for p in ray.get([s.progress.remote() for s in self.servers], timeout=30)]
        except (RayActorError, GetTimeoutError):
            return None  # a server is gone too: the rollback finds which
        step = resume_step(clocks, w)
        if step is None:
            self._failed(Failure("torn_push", w, detected, "pending", injected))
            return None
        self.budget.repair(detected, f"worker {w} died" if hang is None else hang[1])  # (a rollback is one too)
        began = injected if injected is not None else hang[0] if hang else None
        if began is not None:  # from the kill (or the injected hang), or from a hung worker's last step
            self.ledger.move(max(0.0, detected - began), book.PRODUCTIVE, book.DETECTION)
        ray.kill(self.workers[w], no_restart=True)
        drop_holds(self.servers, w)  # the dead worker's held pull, never to be answered
        self.held_calls.clear()  # answers from before may list its holds: they must not fire on the replacement
        self._arm(start, end)  # the replacement's holds of the segment's other faults
        self.workers[w] = self.new_worker(w)
        self._dead_workers.discard(w)
        failure = Failure("worker", w, detected, "replaced", injected, resumed_at=step,
                          pids={"old": self.pids.live.get(("worker", w), -1)}, hung=hang[1] if hang else "")
        self._failed(failure)
        self._pauses[w] = failure
        log.warning("worker %d died at step %d; replaced, resuming there (the other workers go on)", w, step)
        return self._launch(w, step, end)

    def _poll_servers(self, progress: dict, start: int, end: int) -> set[int]:
        """Servers found dead, killed as hung (a progress call unanswered for the hang limit), or killed
        now by an injected kill_server."""
        dead = set()
        for k, (ref, asked_at) in list(progress.items()):
            if not ray.wait([ref], timeout=0)[0]:
                if self.watchdog.server_hung(k, self.servers[k], asked_at):
                    dead.add(k)
                continue
            try:
                self.pids.note("server", k, ray.get(ref).pid)
                self.watchdog.unanswered.discard(k)
                progress[k] = (self.servers[k].progress.remote(), time.time())
            except RayActorError:
                dead.add(k)
        return dead | self._fire(start, end)

    def _fire(self, start: int, end: int) -> set[int]:
        """Fire the faults whose pulls are held now; the servers killed (a stopped actor is the watchdog's)."""
        now, fired = time.time(), fire_held(self.plan, self.servers, self.workers, self.held_calls, start, end)
        self._kills.update({(f.actor, f.target): now for f in fired})
        return {f.target for f in fired if f.kind == "server"}

    # ---- a rollback ----

    def _rollback(self, start: int, streams: dict, dead: set[int], reason: str, productive_at_start: float) -> int:
        """Stop the segment, replace the dead actors, restore EVERY server; the step to rerun from.

        Every server, not only the dead one's shard: a parameter version is a cut across all
        shards, and a restored shard beside live ones at a later version would mix versions (the
        workers would compute on parameters no run ever had), breaking bsp's equality with
        collective dp and every consistency model's bound."""
        detected = time.time()
        self.budget.repair(detected, reason)
        self.ledger.enter(book.REFORMATION)
        for w in list(self._pauses):
            self._close_pause(w, detected)
        injected = [self._kills.pop(("server", k)) for k in dead if ("server", k) in self._kills]
        hangs = self.watchdog.hung_servers
        if began := injected + [since for since, _ in hangs.values()]:  # a kill, or a hung server's silence
            self.ledger.move(max(0.0, detected - min(began)), book.PRODUCTIVE, book.DETECTION)
        lost = self.ledger.totals().get(book.PRODUCTIVE, 0.0) - productive_at_start  # since the last commit
        self.ledger.move(max(0.0, lost), book.PRODUCTIVE, book.LOST)
        for k, server in enumerate(self.servers):
            if k not in dead:
                server.abort.remote()
        if self.ckpt and self.ckpt.preemption and self.ckpt.preemption.signals:  # restoring would outlast the grace
            self.stop_streams(streams, within_s=self.ckpt.preemption.left_s())
            raise self.ckpt.preemption.preempted(self.last_commit(), saved_now=False)
        self.stop_streams(streams)
        dead |= dead_servers(self.servers)
        for k in sorted(dead):
            ray.kill(self.servers[k], no_restart=True)
            self.servers[k] = self.new_server(k)
        for w in sorted(self._dead_workers):
            ray.kill(self.workers[w], no_restart=True)
            self.workers[w] = self.new_worker(w)
        self._dead_workers.clear()
        self._kills.clear()  # every kill so far is dealt with by this rollback: none is a later failure's cause
        self.ledger.enter(book.RESTORE)
        step, from_checkpoint = restores.restore(self)
        self.ledger.move(self.starts.redone(step), book.PRODUCTIVE, book.LOST)  # segments before this one
        booked = len(self.failures)
        self.redone += record_rollback(self.failures, self.logs, dead, reason, detected,
                                       min(injected) if injected else None, step, from_checkpoint,
                                       {k: why for k, (_, why) in hangs.items()})
        for failure in self.failures[booked:]:  # the rollback's own (a torn push's was told when found)
            self._told(failure)
        self.redone += self.logs.rewind(step)  # executions of folded steps the rollback undid
        self.watchdog.forget()
        self.held_calls.clear()
        return step

    def _failed(self, failure: Failure) -> None:
        self.failures.append(failure)
        self._told(failure)

    def _told(self, failure: Failure) -> None:
        if self.on_failure is not None:
            self.on_failure(failure)

    def stop_streams(self, streams: dict, within_s: float = STOP_S) -> None:
        """Wait until every stream ended (aborted servers fail the waiting calls); kill a stuck worker."""
        self._dead_workers |= stop_all(streams, self._on_log, within_s,
                                       lambda w: ray.kill(self.workers[w], no_restart=True), POLL_S)
