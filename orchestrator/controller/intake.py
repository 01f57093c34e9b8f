"""The controller's intake of rank events: one handler per message type.

Protocol (controller thread only): `drain(store)` takes every message queued in the
generation's store (orchestrator.wire.store.GenerationStore.receive) and every notice of the
controller's own chaos (ControllerFaults.drain), oldest first, and hands each to the handler
`HANDLERS` names for its type; a rank's timestamp is first put on the controller's clock
(orchestrator.controller.clock_skew), so no handler subtracts two hosts' clocks. It returns
the steps committed while draining (and those whose manifest creates finished off its thread
since the last drain: Checkpoints.landed, booked before the drain's handlers and again after
them, so a save failing in the drain counts from them), newest last (the training loop may grow the job at a
commit). Called from every state that waits on ranks: the training loop each poll,
RESTORING after a failed restore (to learn a fault that fired there), RECOVERING before and
after the release (late receipts may still complete a checkpoint).

`step_at` is when the newest step record was taken off the store (on the monotonic clock):
a stop step is estimated from it (orchestrator.controller.stopping).

Lost nodes: every rank of a lost node reports it; the first report per node is kept in
`lost_nodes` until the recovery takes it (`take_lost_nodes`); late reports of a node already
handled (possibly drained after the recovery) are not a new failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.controller.checkpoints import JOB_ENDING
from orchestrator.controller.clock_skew import ClockSkew
from orchestrator.controller.faults import describe_fault
from orchestrator.wire.messages import (
    EvalDone,
    FaultFired,
    MemoryReport,
    NodeLost,
    SaveFailed,
    ShardWritten,
    SnapshotHeld,
    StepDone,
)


class EventIntake:
    def __init__(self, record, faults, chaos, checkpoints, metrics, log: Callable[[str], None],
                 on_receipt: Callable[[ShardWritten | SnapshotHeld], int | None],
                 landed: Callable[[], list[int]] = list):
        self.record = record  # JobRecord: step records
        self.faults = faults  # FaultClock: fired faults
        self.chaos = chaos  # ControllerFaults: its notices, and kill_controller per finished step
        self.checkpoints = checkpoints  # Checkpoints: a rank's failed shard write
        self.metrics = metrics
        self.log = log
        self.on_receipt = on_receipt  # the controller's commit path (it knows the layout), for both levels
        self.landed = landed  # the commits whose manifest creates finished off the thread (Checkpoints.landed)
        self.lost_nodes: dict[str, NodeLost] = {}  # node id -> first report
        self.nodes_handled: set[str] = set()
        self.HANDLERS = {StepDone: self._step, ShardWritten: self._receipt, FaultFired: self._fault,
                         NodeLost: self._node_lost, MemoryReport: self._memory, SaveFailed: self._save_failed,
                         EvalDone: self._eval, SnapshotHeld: self.on_receipt}
        self._committed: list[int] = []
        self.clocks = ClockSkew()
        self._store = None  # the generation store drained last
        # time.monotonic() when the newest step record was taken off the store (or, until this
        # generation's first, of its first drain): the ranks went on from there (stopping.py).
        self.step_at = time.monotonic()
        self._taken_at = self.step_at

    def drain(self, store) -> list[int]:
        # Commits the lane finished are booked first: a save failing in this drain counts from them. One
        # that ends the job (SavesFailing, a lost lease) is raised once this drain's records are taken.
        try:
            self._committed, ending = self.landed(), None
        except JOB_ENDING as err:
            self._committed, ending = [], err
        if store is not self._store:  # a new generation: its ranks start now, maybe on other hosts
            self._store, self.step_at = store, time.monotonic()
            self.clocks.reset()
        from_ranks = store.receive()
        self._taken_at = time.monotonic()
        received = self.clocks.clock()
        for message in [*(self.clocks.to_local(m, received) for m in from_ranks), *self.chaos.drain()]:
            self.HANDLERS[type(message)](message)
        self._committed += self.landed()
        if ending is not None:
            raise ending
        return self._committed

    def take_lost_nodes(self) -> list[str]:
        """The lost nodes not yet handled; from now on their late reports are ignored."""
        nodes = list(self.lost_nodes)
        self.nodes_handled.update(nodes)
        self.lost_nodes.clear()
        return nodes

    def _step(self, message: StepDone) -> None:
        self.step_at = self._taken_at  # not now: handling the batch (a commit in it) may take seconds
        self.record.on_step(message)
        self.chaos.on_step(message.step)

    def _eval(self, message: EvalDone) -> None:
        self.step_at = self._taken_at  # the ranks go on from the validation's end
        self.record.on_eval(message)

    def _receipt(self, message: ShardWritten) -> None:
        step = self.on_receipt(message)
        if step is not None:
            self._committed.append(step)

    def _fault(self, message: FaultFired) -> None:
        self.faults.on_fired(message)
        self.chaos.remember(message)  # fired once per job: a later controller of it arms it no more
        self.record.on_fault(message)
        self.log(f"chaos: {describe_fault(message)}")

    def _node_lost(self, message: NodeLost) -> None:
        if message.node not in self.nodes_handled:
            self.lost_nodes.setdefault(message.node, message)

    def _memory(self, message: MemoryReport) -> None:
        if message.ledgers is not None:
            self.metrics.on_memory("measured", message.ledgers)

    def _save_failed(self, message: SaveFailed) -> None:
        self.checkpoints.on_save_failed(message)
