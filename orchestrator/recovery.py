"""The controller's failure path and its event intake (part of `Controller`, split for size).

Recovery, in order (design.md section 2):
  1. Detection: a rank's pending `train` call raised (dead actor) or returned "aborted"
     (its collective failed), or the progress watchdog fired (no step for k x median).
  2. Release: the abort key is set in the generation's store; survivors leave their
     collectives (their own teardown cascades through the ring); any rank not out within
     `release_timeout_s` is killed, so nobody waits for a collective timeout.
  3. Accounting: time from the fault to its detection is `detection`; compute of steps
     after the restore point is `lost_work` (it will be redone).
  4. Decision: the failure policy says restart or fail; the scaling policy says which
     ranks to replace. Survivors keep their processes (torch stays imported); only dead
     ranks get new actors. Then a new generation forms (RENDEZVOUS).
"""

from __future__ import annotations

import time


class RecoveryMixin:
    def _armed_faults(self) -> list[dict]:
        return [f for f in self.faults if f["id"] not in self.fired or f.get("repeat")]

    def _drain_events(self) -> None:
        for event in self.store.drain_events():
            kind = event.get("type")
            if kind == "step":
                self.record.on_step(event)
            elif kind == "receipt":
                self._on_receipt(event)
            elif kind == "fault":
                self.fired[event["fault_id"]] = event
                self.printer(f"[{self.record.job_seconds():7.2f}s] chaos: {event['kind']} on rank "
                             f"{event['rank']} at step {event['step']} ({event['point']})")
            elif kind == "save_error":
                self.printer(f"checkpoint step {event['step']}: rank {event['rank']} failed to write "
                             f"its shard ({event['error']}); the save will not commit")
                self.metrics.on_checkpoint_skipped()

    def _on_receipt(self, event: dict) -> None:
        commit = self.committer.on_receipt(
            event, self.world_size, self.gen, self.layout(),
            lambda: {"goodput": self.ledger.to_dict(), "restarts": self.restarts},
        )
        if commit is None:
            return
        # The ranks' blocking time was booked as productive; it was the save's cost.
        self.ledger.move(commit.blocking_s, "productive", "checkpoint_save")
        interval = self.interval_policy.interval_s(commit.blocking_s)
        self.record.on_checkpoint(commit.step, commit.committed_at, commit.nbytes, commit.blocking_s,
                                  commit.total_s, interval)

    def _failure_from(self, outcomes) -> object:
        """The failure behind the first bad outcomes. An injected fault that fired is the cause
        even when a peer's collective error is reported first; otherwise a dead rank is."""
        from orchestrator.controller import Failure

        died = [o for o in outcomes if o.status == "died"]
        culprit = died[0] if died else outcomes[0]
        fault = next((e for e in self.fired.values() if not e.get("handled")), None)
        if fault:
            fault["handled"] = True
            return Failure(fault["kind"], fault["rank"], time.time(), culprit.info.get("error", ""),
                           fault_time=fault["time"])
        kind = "rank_died" if died else "rank_error"
        return Failure(kind, culprit.rank, time.time(), culprit.info.get("error", ""))

    def _hang_check(self):
        from orchestrator.controller import Failure

        median = self.record.median_step_s()
        limit = max(self.hang_min_s, self.hang_factor * (median or 0.0))
        since = max(self.record.last_step_time, self.gen_started_at)
        if time.time() - since < limit:
            return None
        return Failure("hang", None, time.time(), f"no step for {time.time() - since:.1f} s (limit {limit:.1f} s)")

    def _start_recovery(self, failure) -> None:
        from orchestrator.controller import State

        self.failure = failure
        self.open_failure = self.record.on_failure(failure.kind, failure.rank, failure.detected_at,
                                                   failure.fault_time, failure.message)
        self._book_failure_time(failure)
        who = f"rank {failure.rank}" if failure.rank is not None else "the job"
        after = self.open_failure.detected_after_s
        self._go(State.RECOVERING, f"generation {self.gen}: {failure.kind} on {who}"
                                   + (f", detected after {after * 1000:.0f} ms" if after is not None else "")
                                   + f" ({failure.message[:160]})")

    def _book_failure_time(self, failure) -> None:
        """Move the failure's cost out of `productive`: detection gap, then the rolled-back steps."""
        if failure.fault_time is not None:
            self.ledger.move(max(0.0, failure.detected_at - failure.fault_time), "productive", "detection")

    def _release(self) -> list[int]:
        """Get every rank out of the old generation; returns the ranks that need a new actor."""
        self.store.request_abort()
        started = time.monotonic()
        dead: list[int] = []
        out: dict[int, str] = {}
        while self.workers.running() and time.monotonic() - started < self.release_timeout_s:
            for o in self.workers.wait_any(self.poll_s):
                if o.status == "died":
                    dead.append(o.rank)
                out[o.rank] = f"{(time.monotonic() - started) * 1000:.0f} ms"
        stuck = self.workers.running()
        if self.failure.kind == "hang":  # nobody can tell which rank hung: start every rank afresh
            stuck = sorted(set(self.workers.actors) - set(dead))
        for rank in stuck:
            self.workers.kill(rank)
        self.dead_in_release = sorted(dead)
        dead = sorted(set(dead) | set(stuck) | {r for r in range(self.world_size) if r not in self.workers.actors})
        survivors = [r for r in range(self.world_size) if r not in dead]
        silent = self.workers.leave_all(survivors, timeout_s=self.release_timeout_s)
        for rank in silent:
            self.workers.kill(rank)
        self.printer(f"[{self.record.job_seconds():7.2f}s] release: "
                     + (", ".join(f"rank {r} out after {t}" for r, t in sorted(out.items())) or "no rank returned")
                     + (f"; killed {sorted(set(stuck) | set(silent))} (not out within "
                        f"{self.release_timeout_s:.0f} s)" if stuck or silent else ""))
        return sorted(set(dead) | set(silent))

    def _recovering(self) -> None:
        from orchestrator.controller import State

        started = time.perf_counter()
        self._drain_events()  # late receipts may still complete a checkpoint
        replace = self._release()
        self._drain_events()
        if self.failure.kind == "rank_error" and self.dead_in_release:
            # A neighbour's collective error arrived before Ray reported the death that caused it.
            self.failure.kind, self.failure.rank = "rank_died", self.dead_in_release[0]
            self.open_failure.kind, self.open_failure.rank = "rank_died", self.dead_in_release[0]
        restore_point = self.committer.latest or 0
        lost = self.record.rolled_back_seconds(restore_point, since=self.gen_started_at)
        self.ledger.move(lost, "productive", "lost_work")
        decision = self.failure_policy.decide(self.restarts, self.failure.kind)
        if decision.action == "fail":
            self.error = f"{self.failure.kind} on rank {self.failure.rank}: {decision.reason}"
            self._go(State.FAILED, self.error)
            return
        scaling = self.scaling_policy.decide(self.dp, replace)
        self.restarts += 1
        self.workers.ensure_actors(scaling.replace)
        self.workers.ping_all(timeout_s=self.join_timeout_s)
        cause = f"{self.failure.kind} on rank {self.failure.rank}" if self.failure.rank is not None \
            else self.failure.kind
        self._go(State.RENDEZVOUS, f"generation {self.gen} -> {self.gen + 1}: {cause}; {scaling.reason}; "
                                   f"{lost:.2f} s of work after step {restore_point} to redo; "
                                   f"{decision.reason}; released in {time.perf_counter() - started:.2f} s")

