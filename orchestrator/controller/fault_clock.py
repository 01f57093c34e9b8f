"""The chaos faults as the controller knows them: armed in the ranks, fired, and fired by the clock.

Protocol (controller thread only; one FaultClock per controller run):
  * Built from the spec: step- and point-triggered faults are armed in the ranks' injectors
    (`armed()` is passed with every restore and training start); time-triggered ones
    (explicit `at_seconds`, random ones from `chaos.mtbf_s`) are fired from here.
    Storage faults stay armed whatever their trigger: their `at_seconds` opens a window.
  * `schedule(world_size)` once the ranks' nodes are known (PLACING) expands the schedule
    (chaos.schedule); `skip_before(job_s)` after a resume, so earlier faults do not replay;
    `fire_due()` from the training loop fires what is due on the job clock (the goodput
    ledger's wall time, which a resumed job carries over); one with no rank to fire at is
    logged and appended to `skipped` (the report's `faults_skipped`), and so is one whose
    rank's actor failed the call (gone, or in no generation) with no notice of it firing
    within NOTICE_GRACE_S: an experiment never believes a failure happened that did not.
  * `on_fired(notice)` for each fault notice the event intake receives; `take_fired()` hands
    the oldest not yet blamed to the failure attribution (orchestrator.controller.blame);
    `sweep_fired(before)` marks those a recovery dealt with; `disarm_slow(ranks)` stops the
    slowness of evicted stragglers following them to their replacements.
"""

from __future__ import annotations

from collections.abc import Callable

from chaos.config import STORAGE_KINDS, ArmedFault
from chaos.schedule import expand
from monitor.report import FaultRecord
from orchestrator.cluster.placement_error import PlacementError
from orchestrator.wire.messages import FaultFired

# Random failures are drawn up to this many job seconds ahead (a day).
CHAOS_HORIZON_S = 24 * 3600.0
# A failed injection call is a fault that did not fire unless its notice comes within this long (a kill
# that fired ends the call with the actor's death, its notice on its way through the generation's store).
NOTICE_GRACE_S = 30.0


class FaultClock:
    def __init__(self, spec, workers, clock: Callable[[], float], log: Callable[[str], None],
                 skipped: list[FaultRecord] | None = None):
        self.spec = spec
        # The time-triggered faults that came due with no rank to fire them at (the report's
        # `faults_skipped`): an experiment says how many of its failures never happened.
        self.skipped = [] if skipped is None else skipped
        self.workers = workers
        self.clock = clock
        self.log = log
        self.faults = [ArmedFault.of(f, i) for i, f in enumerate(spec.chaos.faults)
                       if f.at_seconds is None or f.kind in STORAGE_KINDS]
        self.timed: list = []  # chaos.schedule.FaultEvent, by time
        self.timed_next = 0  # index of the next one to fire
        self.fired: dict[int, FaultFired] = {}
        self.places: dict[str, int] = {}  # node id at `schedule` -> the lowest rank it hosted (`_lowest_ranks`)
        self.injected: list[tuple] = []  # (call ref, event, rank, when) of timed faults not yet known to fire

    def schedule(self, world_size: int) -> None:
        """Expand the chaos schedule over the ranks' nodes.

        Random node kills target the ranks' nodes except the controller's own: losing that node
        is losing the controller (kill_controller's job), not a node failure the job survives."""
        self.places = self._lowest_ranks(world_size)  # node drawn for -> its lowest rank then: its failures follow
        nodes = sorted(self.places, key=self.places.get)
        chaos = self.spec.chaos
        if chaos.mtbf_s is not None and chaos.mtbf_kind == "kill_node" and not nodes:
            raise PlacementError("chaos.mtbf_kind=kill_node: every rank runs on the controller's node, so a node "
                                 "kill would kill the controller; run on a multi-node cluster, or use "
                                 "mtbf_kind: kill_rank")
        events = expand(chaos, horizon_s=CHAOS_HORIZON_S, nodes=nodes, ranks=world_size)
        # A storage fault's at_seconds opens its window (chaos.storage_rules): nothing to fire.
        self.timed = sorted((e for e in events if e.at_seconds is not None and e.kind not in STORAGE_KINDS),
                            key=lambda e: (e.at_seconds, e.id))
        self.timed_next = 0

    def _lowest_ranks(self, world_size: int) -> dict[str, int]:
        """The ranks' nodes but the controller's, each with the lowest rank it hosts: in that order a seed
        draws the same failures on any cluster."""
        here, lowest = self.workers.controller_node(), {}
        for rank in range(world_size):
            node = self.workers.node_of(rank)
            if node and node != here:
                lowest.setdefault(node, rank)
        return lowest

    def node_kills_on(self, node: str) -> list[int]:
        """Ranks on `node` that a kill_node fault targets (the controller refuses to kill its own node)."""
        targets = sorted({f.rank for f in self.faults if f.kind == "kill_node" and f.rank is not None})
        targets += sorted({e.rank for e in self.timed if e.kind == "kill_node" and e.rank is not None})
        return [r for r in targets if self.workers.node_of(r) == node]

    def skip_before(self, job_s: float) -> None:
        """A resumed job (its job seconds carried in the ledger) does not replay earlier faults."""
        self.timed_next = max(self.timed_next, sum(1 for e in self.timed if e.at_seconds < job_s))

    def fire_due(self, world_size: int) -> None:
        """Fire the time-triggered faults whose time has come (a cursor: the list is long)."""
        now = self.clock()
        while self.timed_next < len(self.timed) and self.timed[self.timed_next].at_seconds <= now:
            event = self.timed[self.timed_next]
            self.timed_next += 1
            if event.rank is not None:
                rank = event.rank
            else:
                node = self._node_now(event.node)
                on_node = [r for r in sorted(self.workers.actors) if self.workers.node_of(r) == node]
                if node is None or not on_node:
                    self._skip(event, None, f"of node {str(event.node)[:12]} skipped: no rank runs there now, nor on "
                                            "a new node in its place")
                    continue
                rank = on_node[0]
            if rank not in self.workers.actors:
                # After a shrink the job may have fewer ranks than the schedule was drawn for: say
                # so, or the experiment would believe a failure was injected.
                self._skip(event, rank, f"of rank {rank} skipped: the job runs {world_size} rank(s) now")
                continue
            ref = self.workers.inject(rank, event.fault.model_copy(update={"rank": rank}))
            if ref is not None:
                self.injected.append((ref, event, rank, now))
        self._check_injected(now)

    def _node_now(self, drawn: str) -> str | None:
        """The node `drawn`'s failures hit now: itself while it runs ranks; once it is lost, the new node its
        lowest rank moved to (a replacement takes its place); None when that rank went to a node drawn for
        itself (a shrink, a spare there: its rate would double) or is gone."""
        if drawn not in self.places or any(self.workers.node_of(r) == drawn for r in self.workers.actors):
            return drawn
        node = self.workers.node_of(self.places[drawn]) if self.places[drawn] in self.workers.actors else None
        return None if node is None or node in self.places else node

    def _check_injected(self, now: float) -> None:
        """Drop the injections whose fault fired; record as skipped those whose call failed and whose notice
        did not come within NOTICE_GRACE_S (a hang's call never returns: only its notice ends its wait)."""
        waiting = []
        for ref, event, rank, sent in self.injected:
            if event.id in self.fired:
                continue
            error = self.workers.injection_error(ref) if now - sent >= NOTICE_GRACE_S else None
            if error is None:
                waiting.append((ref, event, rank, sent))
            else:
                self._skip(event, rank, f"of rank {rank} not fired: its actor failed the call ({error})")
        self.injected = waiting

    def _skip(self, event, rank: int | None, why: str) -> None:
        self.log(f"chaos: {event.kind} {why}")
        self.skipped.append(FaultRecord(time=self.clock(), kind=event.kind, fault_id=event.id, rank=rank, detail=why))

    def armed(self) -> list[ArmedFault]:
        """The faults ranks arm: not fired yet, or repeating; a storage fault's window reaches late
        joiners, except a data fault's from a step, which a later generation would open again."""
        return [f for f in self.faults if f.id not in self.fired or f.repeat
                or (f.kind in STORAGE_KINDS and f.duration_s and not (f.target == "data" and f.at_step is not None))]

    def on_fired(self, notice: FaultFired) -> None:
        if notice.kind in STORAGE_KINDS:
            notice.handled = True  # a failed save is not a rank failure: never blame one on it
        self.fired[notice.fault_id] = notice

    def take_fired(self) -> FaultFired | None:
        """The injected fault that fired and has not been blamed for a failure yet."""
        fault = next((e for e in self.fired.values() if not e.handled), None)
        if fault is not None:
            fault.handled = True
        return fault

    def sweep_fired(self, before: float) -> None:
        """Faults fired before this failure was noticed are dealt with by this recovery (every rank
        restarts from the checkpoint): never blame one for a later failure (its detection time)."""
        for event in self.fired.values():
            if event.time is not None and event.time <= before:
                event.handled = True

    def disarm_slow(self, ranks: list[int]) -> None:
        """Evicted stragglers' slow_rank faults stay with the evicted processes: chaos slowness stands
        for slow hardware, so the replacement runs at full speed instead of being evicted in turn."""
        for fault in self.faults:
            if fault.kind == "slow_rank" and fault.rank in ranks:
                self.fired.setdefault(fault.id, FaultFired(fault.id, "slow_rank", rank=fault.rank, handled=True))
