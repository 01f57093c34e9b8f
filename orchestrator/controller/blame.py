"""Which failure the controller is recovering from, and who caused it.

Protocol (controller thread only): the training loop asks for a `Failure` when something
went wrong: `from_outcomes` (a rank's `train` call died or returned an error), `node_lost`
(a rank's node watchdog reported its raylet gone), `hang` (no step for too long, polled);
RENDEZVOUS and RESTORING build theirs with `rendezvous_failed` and `restore_failed`. All but
`rendezvous_failed` ask the FaultClock (`from_outcomes` after the evictions): an injected
fault that fired is the cause even when a peer's collective error is reported first, and
taking it marks it blamed, so it is never blamed for a later failure. Once every rank is out
(RECOVERING), `attribute` names the real culprit from what the release learned (who was
dead, who was stuck, which nodes its probe found gone: a node whose processes all ended at once
leaves no watchdog to report it) and returns what the failure policy needs to know of it.

Evictions: the straggler watch records the ranks it kills on purpose (`evicting`); their
deaths are `straggler_evicted`, not `rank_died`.
"""

from __future__ import annotations

import time
from typing import get_args

from chaos.config import RandomKind
from orchestrator.controller.errors import is_peer_failure, normalise
from orchestrator.controller.fault_clock import FaultClock
from orchestrator.controller.policies import FailureSummary
from orchestrator.controller.states import Failure
from orchestrator.wire.messages import NodeLost

# The machine failures chaos injects (the random kinds): never a crash loop (FailurePolicy).
MACHINE_FAULTS = frozenset(get_args(RandomKind))


class Blame:
    def __init__(self, faults: FaultClock, record):
        self.faults = faults
        self.record = record  # orchestrator.controller.job_record.JobRecord: the steps seen so far
        self.evicting: set[int] = set()  # stragglers this controller killed on purpose

    def current_step(self) -> int | None:
        """The step the running generation was on: after a rollback, not past the furthest ever reached."""
        return self.record.completed_steps() if self.record.last_step >= 0 else None

    def _from_fault(self, message: str, default: Failure) -> Failure:
        fault = self.faults.take_fired()
        if fault is None:
            return default
        return Failure(fault.kind, fault.rank, time.time(), message, fault_time=fault.time, step=fault.step,
                       errors=default.errors)

    def from_outcomes(self, outcomes) -> Failure:
        """The failure behind the first bad outcomes (orchestrator.cluster.worker_group.RankOutcome)."""
        died = [o for o in outcomes if o.status == "died"]
        # A rank's own error before the peers' collective errors it caused, whichever came back first.
        own = [o for o in outcomes if not is_peer_failure(str(o.info.get("error", "")))]
        culprit = died[0] if died else (own or outcomes)[0]
        errors = {o.rank: o.info.get("error", o.status) for o in outcomes}
        evicted = self.take_evicted({o.rank for o in died})
        if evicted:
            return Failure("straggler_evicted", evicted[0], time.time(), "evicted as a sustained straggler",
                           step=self.current_step(), errors=errors)
        kind = "rank_died" if died else "rank_error"
        default = Failure(kind, culprit.rank, time.time(), culprit.info.get("error", ""),
                          step=culprit.info.get("step", self.current_step()), errors=errors)
        return self._from_fault(culprit.info.get("error", ""), default)

    def take_evicted(self, dead: set[int]) -> list[int]:
        """The dead ranks the straggler watch killed on purpose; forgets the evictions and disarms
        those ranks' slow_rank faults (FaultClock.disarm_slow)."""
        evicted = sorted(self.evicting & dead)
        if evicted:
            self.evicting.clear()
            self.faults.disarm_slow(evicted)
        return evicted

    def node_lost(self, lost: dict[str, NodeLost]) -> Failure:
        """The first lost node's report, or the kill_node fault that caused it."""
        node, event = next(iter(lost.items()))
        ranks = sorted(e.rank for e in lost.values())
        message = f"node {node[:12]} lost (raylet gone), reported by rank {event.rank}"
        fault = self.faults.take_fired()
        if fault is not None:  # the kill_node fault: its rank, but the step the job was at
            return Failure(fault.kind, fault.rank, time.time(), message, fault_time=fault.time,
                           step=self.current_step())
        return Failure("node_lost", ranks[0] if ranks else None, time.time(), message, step=self.current_step())

    def hang(self, since: float, limit_s: float, field: str = "elastic.hang_timeout_s",
             why: str | None = None) -> Failure | None:
        """A hang when no step came for `limit_s` since `since` (time.monotonic() of the last step, or
        of the generation's start): a watchdog on the wall clock would fire at an NTP step. `field`:
        the spec field that sets the limit; `why`: what else the message should say (a stalled save)."""
        quiet = time.monotonic() - since
        if quiet < limit_s:
            return None
        message = f"no step for {quiet:.1f} s (limit {limit_s:.1f} s, {field})" + (f": {why}" if why else "")
        # The step was due a usual step after the last progress, and after what was booked since
        # (a validation, a save's blocking): from then the job only waited to be declared hung.
        now, due = time.time(), (self.record.median_step_s() or 0.0) + self.record.booked_since_step
        return self._from_fault(message, Failure("hang", None, now, message, step=self.current_step(),
                                                 stalled_at=now - quiet + min(due, quiet)))

    def rendezvous_failed(self, err: BaseException) -> Failure:
        return Failure("rendezvous", None, time.time(), f"{type(err).__name__}: {err}")

    def restore_failed(self, err: BaseException) -> Failure:
        """A rank's restore failed: blame a fault that fired there (during_restore) if one did, so it
        is disarmed before the next restore. The caller drains the events first."""
        message = f"{type(err).__name__}: {err}"
        fault = self.faults.take_fired()
        if fault is not None:
            return Failure(fault.kind, fault.rank, time.time(), message, fault_time=fault.time, step=fault.step)
        return Failure("restore", None, time.time(), message)

    @staticmethod
    def _crash_explains(failure: Failure, crashed: dict[str, list[int]]) -> bool:
        """Whether a gone node explains `failure`: a death or a hang, or an error of a rank there or of
        a peer's collective (a rank's own error on a live node is a cause of its own)."""
        if failure.kind in ("rank_died", "hang"):
            return True
        there = {rank for ranks in crashed.values() for rank in ranks}
        return failure.kind == "rank_error" and (failure.rank in there
                                                 or is_peer_failure(failure.errors.get(failure.rank, "")))

    def attribute(self, failure: Failure, dead: list[int], stuck: list[int],
                  crashed: dict[str, list[int]] | None = None) -> FailureSummary:
        """Name the real culprit once every rank's outcome is known (`crashed`: the nodes the release's
        probe found gone, with their ranks); updates `failure` and its record."""
        culprit = None
        # A peer's collective error can be seen before the evicted rank's death. An eviction
        # that coincided with another failure is still forgotten (and its slowness disarmed).
        evicted = self.take_evicted(set(dead))
        on_crashed = [(node, ranks[0]) for node, ranks in (crashed or {}).items() if ranks]
        if evicted and failure.kind == "rank_error":
            culprit, kind = evicted[0], "straggler_evicted"
        elif on_crashed and self._crash_explains(failure, crashed):
            # A gone node: its ranks looked dead or hung, and their peers' collectives failed.
            (node, culprit), kind = on_crashed[0], "node_lost"
            failure.message = failure.record.message = f"node {node[:12]} lost (its raylet is gone)"
        elif failure.kind == "rank_error" and dead:
            culprit, kind = dead[0], "rank_died"
        elif failure.kind == "rank_error" and is_peer_failure(failure.errors.get(failure.rank, "")):
            # Every outcome is in now: the first rank whose error is its own, not a peer's failure.
            own = sorted(r for r, error in failure.errors.items() if not is_peer_failure(error))
            culprit, kind = (own[0], "rank_error") if own else (None, None)
        elif failure.kind == "hang" and stuck:
            culprit, kind = stuck[0], "hang"
        if culprit is not None:
            failure.kind, failure.rank = kind, culprit
            failure.record.kind, failure.record.rank = kind, culprit
        error = failure.errors.get(failure.rank, failure.message)
        machine = failure.fault_time is not None and failure.kind in MACHINE_FAULTS
        return FailureSummary(failure.kind, failure.rank, failure.step, normalise(error), failure.detected_at,
                              injected_machine_fault=machine)
