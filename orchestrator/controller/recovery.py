"""The controller's failure path and its event intake (part of `Controller`, split for size).

Recovery, in order (design.md section 2):
  1. Detection: a rank's pending `train` call raised (dead actor) or returned "aborted"
     (its collective failed), or the progress watchdog fired (no step for k x median).
  2. Release: the abort key is set in the generation's store; every live rank's watcher
     breaks its own collectives (orchestrator.rank.comm_abort), so survivors are out within
     milliseconds; a rank not out within `release_timeout_s` (a hung process) is killed.
  3. Accounting: time from the fault to its detection is `detection`; compute of steps
     after the restore point is `lost_work` (it will be redone).
  4. Decision: the failure policy says restart or fail (budget, crash loop).
  5. Membership: lost ranks are taken over by warm spares, else by new actors that must
     start within `elastic.replace_timeout_s`, else data parallelism shrinks to the largest
     valid degree. Survivors keep their processes. Then a new generation forms.
Growing back is the same path without a failure: at a checkpoint commit, when warm spares could
raise dp towards its target, the generation is stopped and re-formed larger."""

from __future__ import annotations

import time

from chaos.config import STORAGE_KINDS
from chaos.schedule import expand
from orchestrator.cluster.worker_group import PlacementError
from orchestrator.controller.errors import collapse, normalise
from orchestrator.controller.faults import describe_fault
from orchestrator.controller.policies import FailureSummary
from orchestrator.controller.states import Failure, State

# Random failures are drawn up to this many job seconds ahead (a day).
CHAOS_HORIZON_S = 24 * 3600.0
# A new checkpoint cadence starts this many steps after the fastest rank's current step.
REPLAN_LEAD_STEPS = 3


class RecoveryMixin:
    def _schedule_timed_faults(self) -> None:
        """Expand the chaos schedule once the ranks' nodes are known (chaos.schedule).

        Random node kills target the ranks' nodes except the controller's own: losing that node
        is losing the controller (kill_controller's job), not a node failure the job survives."""
        here = self.workers.controller_node()
        nodes = sorted({n for r in range(self.world_size) if (n := self.workers.node_of(r))} - {here})
        chaos = self.spec.chaos
        if chaos.mtbf_s is not None and chaos.mtbf_kind == "kill_node" and not nodes:
            raise PlacementError("chaos.mtbf_kind=kill_node: every rank runs on the controller's node, so a node "
                                 "kill would kill the controller; run on a multi-node cluster, or use "
                                 "mtbf_kind: kill_rank")
        events = expand(self.spec.chaos, horizon_s=CHAOS_HORIZON_S, nodes=nodes, ranks=self.world_size)
        # A storage fault's at_seconds opens its window (chaos.storage_rules): nothing to fire.
        self.timed = sorted((e for e in events if e.at_seconds is not None and e.kind not in STORAGE_KINDS),
                            key=lambda e: (e.at_seconds, e.id))
        self.timed_next = 0

    def _skip_faults_before(self, job_s: float) -> None:
        """A resumed job (its job seconds carried in the ledger) does not replay earlier faults."""
        self.timed_next = max(self.timed_next, sum(1 for e in self.timed if e.at_seconds < job_s))

    def _fire_due_faults(self) -> None:
        """Fire the time-triggered faults whose time has come (a cursor: the list is long).

        The clock is the ledger's wall time, which a resumed job carries over from its checkpoint."""
        now = self.ledger.wall()
        while self.timed_next < len(self.timed) and self.timed[self.timed_next].at_seconds <= now:
            event = self.timed[self.timed_next]
            self.timed_next += 1
            if event.rank is not None:
                rank = event.rank
            else:
                on_node = [r for r in sorted(self.workers.actors) if self.workers.node_of(r) == event.node]
                if not on_node:
                    self.printer(f"[{self.record.job_seconds():7.2f}s] chaos: {event.kind} of node "
                                 f"{str(event.node)[:12]} skipped: no rank runs there now")
                    continue
                rank = on_node[0]
            if rank not in self.workers.actors:
                # After a shrink the job may have fewer ranks than the schedule was drawn for: say
                # so, or the experiment would believe a failure was injected.
                self.printer(f"[{self.record.job_seconds():7.2f}s] chaos: {event.kind} of rank {rank} "
                             f"skipped: the job runs {self.world_size} rank(s) now")
                continue
            self.workers.inject(rank, dict(event.fault, rank=rank))

    def _armed_faults(self) -> list[dict]:  # a storage fault's window of job seconds reaches late joiners
        return [f for f in self.faults if f["id"] not in self.fired or f.get("repeat")
                or (f["kind"] in STORAGE_KINDS and f.get("duration_s"))]

    def _drain_events(self) -> None:
        for event in [*self.store.drain_events(), *self.chaos.drain()]:
            kind = event.get("type")
            if kind == "step":
                self.record.on_step(event)
                self.chaos.on_step(event["step"])
            elif kind == "receipt":
                self._on_receipt(event)
            elif kind == "fault":
                if event["kind"] in STORAGE_KINDS:
                    event["handled"] = True  # a failed save is not a rank failure: never blame one on it
                self.fired[event["fault_id"]] = event
                self.printer(f"[{self.record.job_seconds():7.2f}s] chaos: {describe_fault(event)}")
            elif kind == "node_lost" and event["node"] not in self.nodes_handled:
                # Every rank of a lost node reports it; the first report is acted on, late ones
                # (possibly drained after the recovery) are not a new failure.
                self.lost_node_events.setdefault(event["node"], event)
            elif kind == "memory" and event["ledgers"] is not None:
                self.metrics.on_memory("measured", event["ledgers"])
            elif kind == "save_error":
                self.committer.abandon(event["step"], f"rank {event['rank']} failed to write its shard "
                                                      f"({event['error']})")

    def _on_receipt(self, event: dict) -> None:
        commit = self.committer.on_receipt(
            event, self.world_size, self.gen, self.layout(),
            # The history travels with the checkpoint, so a rerun of a dead controller knows which
            # steps the model it restores holds (orchestrator.controller.step_history, the data-exactly-once check).
            lambda: {"goodput": self.ledger.to_dict(), "restarts": self.restarts,
                     "history": list(self.record.history)},
        )
        if commit is None:
            return
        self.bad_steps.discard(commit.step)  # a quarantined step saved and committed again is good
        self.chaos.after_commit(commit.step, self.fired)
        # The ranks' blocking time was booked as productive; it was the save's cost.
        self.ledger.move(commit.blocking_s, "productive", "checkpoint_save")
        self.interval_policy.on_save_cost(commit.blocking_s)
        self.record.on_checkpoint(commit.step, commit.committed_at, commit.nbytes, commit.blocking_s,
                                  commit.total_s, self.interval_policy.interval_s())
        self.metrics.on_interval_inputs(self.interval_policy.inputs.snapshot())
        self._maybe_replan()
        self.just_committed = commit.step

    def _failure_from(self, outcomes):
        """The failure behind the first bad outcomes. An injected fault that fired is the cause
        even when a peer's collective error is reported first; otherwise a dead rank is."""
        died = [o for o in outcomes if o.status == "died"]
        culprit = died[0] if died else outcomes[0]
        self.outcome_errors = {o.rank: o.info.get("error", o.status) for o in outcomes}
        evicted = self._take_evicted({o.rank for o in died})
        if evicted:
            return Failure("straggler_evicted", evicted[0], time.time(), "evicted as a sustained straggler",
                           step=self._current_step())
        fault = self._take_fired_fault()
        if fault:
            return Failure(fault["kind"], fault["rank"], time.time(), culprit.info.get("error", ""),
                           fault_time=fault["time"], step=fault["step"])
        kind = "rank_died" if died else "rank_error"
        return Failure(kind, culprit.rank, time.time(), culprit.info.get("error", ""),
                       step=culprit.info.get("step", self._current_step()))

    def _take_evicted(self, dead: set[int]) -> list[int]:
        """The dead ranks the straggler hook killed on purpose (controller._watch_stragglers).

        Forgets the evictions and disarms the slow_rank faults of those ranks: chaos slowness
        stands for slow hardware, which leaves with the evicted process, so the replacement
        (a warm spare or a new actor) runs at full speed instead of being evicted in turn."""
        evicted = sorted(self.evicting & dead)
        if evicted:
            self.evicting.clear()
            for fault in self.faults:
                if fault["kind"] == "slow_rank" and fault.get("rank") in evicted:
                    self.fired.setdefault(fault["id"], {"type": "fault", "fault_id": fault["id"], "kind": "slow_rank",
                                                        "rank": fault["rank"], "handled": True})
        return evicted

    def _model_parallel(self) -> int:
        return self.spec.parallel.tp * self.spec.parallel.pp

    def _ranks_to_keep(self, alive: list[int], new_dp: int) -> list[int]:
        """The `new_dp` x tp x pp live ranks that form the smaller job, in their new rank order.

        Whole model-parallel groups (the tp x pp ranks of one dp replica) come first, so that
        TP groups stay on the node they were placed on; gaps are filled with other live ranks."""
        group = self._model_parallel()
        whole = [r for start in range(0, self.world_size, group)
                 if all(m in alive for m in range(start, start + group)) for r in range(start, start + group)]
        rest = [r for r in alive if r not in whole]
        return (whole + rest)[:new_dp * group]

    def _maybe_replan(self) -> None:
        """After a commit: publish a new cadence when the measured costs moved it by over 20%.

        The first plan (at restore) knows no save cost yet and probes; this is where a
        time-based interval (young, young-daly, every_seconds) takes effect. The new anchor is
        ahead of the fastest rank, so ranks picking the plan up at slightly different steps
        still agree on every save step after it."""
        every = self.interval_policy.every([r.step_s for r in self.record.steps.values()])
        if abs(every - self.plan_every) <= 0.2 * self.plan_every:
            return
        anchor = max(self.committer.latest or 0, (self._current_step() or 0) + REPLAN_LEAD_STEPS)
        self._publish_plan(anchor)
        self.printer(f"[{self.record.job_seconds():7.2f}s] checkpoint cadence: every {self.plan_every} steps "
                     f"from step {anchor} (interval {self.interval_policy.interval_s() or 0:.1f} s)")

    def _node_failure(self) -> Failure:
        """A rank reported its node's raylet gone (RankActor's node watchdog)."""
        node, event = next(iter(self.lost_node_events.items()))
        ranks = sorted(e["rank"] for e in self.lost_node_events.values())
        self.outcome_errors = {}
        fault = self._take_fired_fault()
        message = f"node {node[:12]} lost (raylet gone), reported by rank {event['rank']}"
        rank = fault["rank"] if fault else (ranks[0] if ranks else None)
        return Failure(fault["kind"] if fault else "node_lost", rank, time.time(), message,
                       fault_time=fault["time"] if fault else None, step=self._current_step())

    def _forget_lost_nodes(self) -> None:
        """Drop the ranks of lost nodes without waiting for Ray to notice (it takes 12-15 s)."""
        for node in list(self.lost_node_events):
            self.nodes_handled.add(node)
            for rank in self.workers.forget_node(node):
                self.outcome_errors.setdefault(rank, f"node {node[:12]} lost")
        self.lost_node_events.clear()

    def _sweep_fired_faults(self, before: float) -> None:
        """Faults fired before this failure was noticed are dealt with by this recovery (every rank
        restarts from the checkpoint): never blame one for a later failure (its detection time)."""
        for event in (e for e in self.fired.values() if e.get("time") is not None and e["time"] <= before):
            event["handled"] = True

    def _take_fired_fault(self) -> dict | None:
        """The injected fault that fired and has not been blamed for a failure yet."""
        fault = next((e for e in self.fired.values() if not e.get("handled")), None)
        if fault is not None:
            fault["handled"] = True
        return fault

    def _restore_failure(self, err: BaseException) -> Failure:
        """A rank's restore failed: blame a fault that fired there (during_restore) if one did, so it
        is disarmed before the next restore and never blamed for a later failure."""
        self._drain_events()
        message = f"{type(err).__name__}: {err}"
        fault = self._take_fired_fault()
        if fault is not None:
            return Failure(fault["kind"], fault.get("rank"), time.time(), message, fault_time=fault["time"],
                           step=fault.get("step"))
        return Failure("restore", None, time.time(), message)

    def _current_step(self) -> int | None:
        return max(self.record.steps) + 1 if self.record.steps else None

    def _hang_check(self):
        median = self.record.median_step_s()
        limit = max(self.hang_min_s, self.hang_factor * (median or 0.0))
        since = max(self.record.last_step_time, self.gen_started_at)
        if time.time() - since < limit:
            return None
        self.outcome_errors = {}
        message = f"no step for {time.time() - since:.1f} s (limit {limit:.1f} s)"
        fault = self._take_fired_fault()
        if fault:
            return Failure(fault["kind"], fault["rank"], time.time(), message, fault_time=fault["time"],
                           step=fault["step"])
        return Failure("hang", None, time.time(), message, step=self._current_step())

    def _start_recovery(self, failure) -> None:
        self.failure = failure
        self.open_failure = self.record.on_failure(failure.kind, failure.rank, failure.detected_at,
                                                   failure.fault_time, failure.message, failure.step)
        self.interval_policy.on_failure()
        if failure.fault_time is not None:
            # From the fault, but not before this generation trained (earlier time has its bucket).
            since = max(failure.fault_time, self.gen_started_at or failure.fault_time)
            self.ledger.move(max(0.0, failure.detected_at - since), "productive", "detection")
        who = f"rank {failure.rank}" if failure.rank is not None else "the job"
        after = self.open_failure.detected_after_s
        self._go(State.RECOVERING, f"generation {self.gen}: {failure.kind} on {who}"
                                   + (f", detected after {after * 1000:.0f} ms" if after is not None else "")
                                   + f" ({normalise(failure.message)})")

    def _release(self) -> list[int]:
        """Get every rank out of the old generation; returns the ranks that need a new actor."""
        self.store.request_abort()
        self._forget_lost_nodes()
        finished, stuck = self._wait_out()
        for rank, (outcome, _) in finished.items():
            self.outcome_errors.setdefault(rank, outcome.info.get("error", outcome.status))
        # Died in the trigger or while we waited: their actors are gone (stuck ones never finished).
        dead = [r for r in self.outcome_errors if r not in self.workers.actors]
        survivors = [r for r in range(self.world_size) if r in self.workers.actors]
        silent = self.workers.leave_all(survivors, timeout_s=self.release_timeout_s)
        for rank in silent:
            self.workers.kill(rank)
        self.dead_in_release = sorted(set(dead))
        self.stuck_in_release = sorted(set(stuck) | set(silent))
        slowest = max((seconds for _, seconds in finished.values()), default=0.0)
        self.printer(f"[{self.record.job_seconds():7.2f}s] release: {len(finished)} rank(s) out within "
                     f"{slowest * 1000:.0f} ms" + (f"; killed {self.stuck_in_release} (not out within "
                                                   f"{self.release_timeout_s:.0f} s)" if self.stuck_in_release else "")
                     + (f"; errors {collapse(self.outcome_errors)}" if self.outcome_errors else ""))
        return [r for r in range(self.world_size) if r not in self.workers.actors]

    def _attribute_failure(self) -> None:
        """Name the real culprit once every rank's outcome is known."""
        culprit = None
        # A peer's collective error can be seen before the evicted rank's death. An eviction
        # that coincided with another failure is still forgotten (and its slowness disarmed).
        evicted = self._take_evicted(set(self.dead_in_release))
        if evicted and self.failure.kind == "rank_error":
            culprit, kind = evicted[0], "straggler_evicted"
        elif self.failure.kind == "rank_error" and self.dead_in_release:
            culprit, kind = self.dead_in_release[0], "rank_died"
        elif self.failure.kind == "hang" and self.stuck_in_release:
            culprit, kind = self.stuck_in_release[0], "hang"
        if culprit is not None:
            self.failure.kind, self.failure.rank = kind, culprit
            self.open_failure.kind, self.open_failure.rank = kind, culprit
        error = self.outcome_errors.get(self.failure.rank, self.failure.message)
        self.failure_history.append(FailureSummary(self.failure.kind, self.failure.rank, self.failure.step,
                                                   normalise(error)))

    def _recovering(self) -> None:
        started = time.perf_counter()
        self._drain_events()  # late receipts may still complete a checkpoint
        lost_ranks = self._release()
        self._drain_events()
        self._attribute_failure()
        self._sweep_fired_faults(self.failure.detected_at)
        restore_point = self.committer.latest or 0
        lost = self.record.rolled_back_seconds(restore_point, since=self.gen_started_at,
                                               failed_at=self.failure.fault_time)
        self.ledger.move(lost, "productive", "lost_work")
        decision = self.failure_policy.decide(self.failure_history)
        if decision.action == "fail":
            self.error = f"{self.failure.kind} on rank {self.failure.rank}: {decision.reason}"
            self._go(State.FAILED, self.error)
            return
        self.restarts += 1
        membership = self._replace(lost_ranks)
        if membership is None:
            return
        cause = f"{self.failure.kind} on rank {self.failure.rank}" if self.failure.rank is not None \
            else self.failure.kind
        self._go(State.RENDEZVOUS, f"generation {self.gen} -> {self.gen + 1}: {cause}; {membership}; "
                                   f"{lost:.2f} s of work after step {restore_point} to redo; "
                                   f"{decision.reason}; released in {time.perf_counter() - started:.2f} s")

    def _replace(self, lost_ranks: list[int]) -> str | None:
        """Fill the lost ranks (spares, then new actors) or shrink dp; None when the job failed."""
        if not lost_ranks:
            return f"no rank lost, dp stays {self.dp}"
        cold = self.workers.promote_spares(lost_ranks)
        words = [f"rank(s) {sorted(set(lost_ranks) - set(cold))} taken over by warm spares"] if len(cold) < len(
            lost_ranks) else []
        late = self.workers.replace_cold(cold, self.spec.elastic.replace_timeout_s) if cold else []
        if cold and len(late) < len(cold):
            words.append(f"rank(s) {sorted(set(cold) - set(late))} replaced by new actors")
        if late:
            alive = sorted(self.workers.actors)
            new_dp = self.scaling_policy.best_dp(len(alive))
            if new_dp is None:
                self.error = (f"{len(alive)} rank(s) left and no replacement within "
                              f"{self.spec.elastic.replace_timeout_s:.0f} s; cannot shrink below "
                              f"elastic.min_dp={self.spec.elastic.min_dp}")
                self._go(State.FAILED, self.error)
                return None
            words.append(f"no replacement for rank(s) {late} within {self.spec.elastic.replace_timeout_s:.0f} s, "
                         f"shrinking dp {self.dp} -> {new_dp} (grad accumulation absorbs it)")
            self.workers.renumber(self._ranks_to_keep(alive, new_dp))
            self.dp = new_dp
        if self.spec.elastic.spares or self.dp < self.spec.parallel.dp:
            self.workers.start_spares()
        return "; ".join(words) or f"dp stays {self.dp}"

    def _maybe_grow(self) -> bool:
        """At a checkpoint commit: re-form larger when warm spares allow; True when started."""
        if self.dp >= self.spec.parallel.dp or not self.spec.elastic.grow:
            return False
        # Bundles that were on a lost node come back when Ray re-places them (a node joined):
        # start spares there now, so that a later commit can grow onto them.
        self.workers.start_spares()
        ready = len(self.workers.ready_spares())
        new_dp = self.scaling_policy.best_dp(self.world_size + ready)
        if new_dp is None or new_dp <= self.dp:
            return False
        step = self.just_committed
        self.failure = None
        self.store.request_abort()
        self._wait_out()
        survivors = [r for r in range(self.world_size) if r in self.workers.actors]
        self.workers.leave_all(survivors, timeout_s=self.release_timeout_s)
        lost = self.record.rolled_back_seconds(step, since=self.gen_started_at)
        self.ledger.move(lost, "productive", "lost_work")
        old, self.dp = self.dp, new_dp
        self.workers.grow(new_dp * self._model_parallel())
        self._go(State.RENDEZVOUS, f"generation {self.gen} -> {self.gen + 1}: growing dp {old} -> {new_dp} at "
                                   f"checkpoint step {step} ({ready} warm spare(s) ready)")
        return True

    def _wait_out(self) -> tuple[dict, list[int]]:
        """After the abort key is set: wait up to `release_timeout_s` for every running rank's
        `train` call, then kill the ranks still inside it (hung). Returns each finished rank's
        (outcome, seconds since the wait began) and the killed ranks."""
        started = time.monotonic()
        finished: dict = {}
        while self.workers.running() and time.monotonic() - started < self.release_timeout_s:
            for outcome in self.workers.wait_any(self.poll_s):
                finished[outcome.rank] = (outcome, time.monotonic() - started)
        stuck = self.workers.running()
        for rank in stuck:
            self.workers.kill(rank)
        return finished, stuck
