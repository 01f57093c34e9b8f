"""The controller's states, the data each one carries, and the one table of legal transitions.

    PLACING        -> RENDEZVOUS | FAILED | PREEMPTED
    RENDEZVOUS     -> RESTORING | RECOVERING | FAILED | PREEMPTED
    RESTORING      -> RUNNING | RECOVERING | SUCCEEDED | FAILED | PREEMPTED
    RUNNING        -> RENDEZVOUS | CHECKPOINTING | STOPPING | RECOVERING | SUCCEEDED | FAILED | PREEMPTED
    CHECKPOINTING  -> RENDEZVOUS | RUNNING | STOPPING | RECOVERING | SUCCEEDED | FAILED | PREEMPTED
    STOPPING       -> RENDEZVOUS | RECOVERING | SUCCEEDED | FAILED | PREEMPTED
    RECOVERING     -> RENDEZVOUS | FAILED | PREEMPTED

(`diagram()` prints this table from `TRANSITIONS`; a test holds the two equal.) What each
edge means: RENDEZVOUS -> RECOVERING when the process group cannot form; RESTORING ->
RECOVERING when a rank's restore fails (a corrupt checkpoint instead stays in RESTORING and
falls back to the previous one); RESTORING -> SUCCEEDED when the restored step is the last;
RUNNING <-> CHECKPOINTING from a save's first receipt to its commit (training goes on);
RUNNING/CHECKPOINTING -> RENDEZVOUS when warm spares let dp grow back at a commit;
RECOVERING -> RENDEZVOUS with the new membership. Any state fails on an unexpected error.
RUNNING/CHECKPOINTING -> STOPPING when the job must end its generation at a step boundary
(a SIGTERM/SIGINT, or a node of the job being drained; orchestrator.controller.stopping):
every rank saves the stop step and returns; then STOPPING -> PREEMPTED (a signal: exit 75)
or -> RENDEZVOUS without the drained node. Any live state -> PREEMPTED on a SIGINT after the first signal or
a signal outside training (nothing trained since the last commit), leaving the last commit.

Every state is a small dataclass holding what only that state needs: RECOVERING the
`Failure` being handled; RENDEZVOUS, RESTORING and the training states the failure whose
recovery is still open (closed when training runs again, which measures the recovery);
CHECKPOINTING the step being saved; STOPPING the stop step, why, and by when.
The controller (orchestrator.controller.machine) holds
one of them as its `phase`; `Controller._go` checks each transition against `TRANSITIONS`,
and an illegal one raises `IllegalTransition`: it is a bug, never a user mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar


class State(str, Enum):
    PLACING = "PLACING"
    RENDEZVOUS = "RENDEZVOUS"
    RESTORING = "RESTORING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    STOPPING = "STOPPING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"


TERMINAL = (State.SUCCEEDED, State.FAILED, State.PREEMPTED)

_S = State
_ENDS = {_S.FAILED, _S.PREEMPTED}  # every live state can fail, and be preempted
TRANSITIONS: dict[State, frozenset[State]] = {
    _S.PLACING: frozenset({_S.RENDEZVOUS, *_ENDS}),
    _S.RENDEZVOUS: frozenset({_S.RESTORING, _S.RECOVERING, *_ENDS}),
    _S.RESTORING: frozenset({_S.RUNNING, _S.RECOVERING, _S.SUCCEEDED, *_ENDS}),
    _S.RUNNING: frozenset({_S.CHECKPOINTING, _S.STOPPING, _S.RECOVERING, _S.RENDEZVOUS, _S.SUCCEEDED, *_ENDS}),
    _S.CHECKPOINTING: frozenset({_S.RUNNING, _S.STOPPING, _S.RECOVERING, _S.RENDEZVOUS, _S.SUCCEEDED, *_ENDS}),
    _S.STOPPING: frozenset({_S.RENDEZVOUS, _S.RECOVERING, _S.SUCCEEDED, *_ENDS}),
    _S.RECOVERING: frozenset({_S.RENDEZVOUS, *_ENDS}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.PREEMPTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """The controller tried an edge `TRANSITIONS` does not have: a bug in the controller."""


def diagram() -> str:
    """The transition table as the module docstring shows it, one source state a line."""
    order = list(State)
    lines = []
    for state in order:
        targets = sorted(TRANSITIONS[state], key=order.index)
        if targets:
            lines.append(f"    {state.value:<14} -> " + " | ".join(t.value for t in targets))
    return "\n".join(lines)


@dataclass
class Failure:
    """A failure the controller is handling, from its detection to the end of its recovery."""

    kind: str
    rank: int | None
    detected_at: float  # time.time() when the controller noticed
    message: str
    fault_time: float | None = None  # time.time() an injected fault fired, when known
    # A hang no injected fault explains: time.time() its step was due (the last progress plus a
    # usual step), after which the job only waited to be declared hung.
    stalled_at: float | None = None
    step: int | None = None  # the step being computed when it failed
    errors: dict[int, str] = field(default_factory=dict)  # each failed rank's error, as it returned
    record: object | None = None  # its monitor.report.FailureRecord, once the job record has it
    superseded: Failure | None = None  # the recovery still open when this one began (closed with this one)

    @property
    def onset(self) -> float | None:
        """When the job stopped making progress, as far as it is known: the injected fault, or a stall."""
        return self.fault_time if self.fault_time is not None else self.stalled_at


@dataclass
class TrainingRun:
    """One generation's training, shared by RUNNING and CHECKPOINTING (saves run beside it)."""

    recovering: Failure | None = None  # closed (recovery measured) when training starts
    started: bool = False
    finished: set[int] = field(default_factory=set)  # ranks whose train call returned done


@dataclass(frozen=True)
class Placing:
    state: ClassVar[State] = State.PLACING


@dataclass(frozen=True)
class Rendezvous:
    state: ClassVar[State] = State.RENDEZVOUS
    recovering: Failure | None = None


@dataclass(frozen=True)
class Restoring:
    state: ClassVar[State] = State.RESTORING
    recovering: Failure | None = None


@dataclass(frozen=True)
class Running:
    state: ClassVar[State] = State.RUNNING
    run: TrainingRun = field(default_factory=TrainingRun)


@dataclass(frozen=True)
class Checkpointing:
    state: ClassVar[State] = State.CHECKPOINTING
    run: TrainingRun
    step: int  # the save in flight, from its first receipt to its commit


@dataclass(frozen=True)
class Stopping:
    """The generation ends at `step`, checkpointed: a signal (`node` None) or `node` draining."""

    state: ClassVar[State] = State.STOPPING
    run: TrainingRun
    step: int
    reason: str
    deadline: float  # time.monotonic() by which the stop step must be committed
    node: str | None = None


@dataclass(frozen=True)
class Recovering:
    state: ClassVar[State] = State.RECOVERING
    failure: Failure


@dataclass(frozen=True)
class Succeeded:
    state: ClassVar[State] = State.SUCCEEDED


@dataclass(frozen=True)
class Failed:
    state: ClassVar[State] = State.FAILED
    error: str


@dataclass(frozen=True)
class Preempted:
    state: ClassVar[State] = State.PREEMPTED
    reason: str


Phase = (Placing | Rendezvous | Restoring | Running | Checkpointing | Stopping | Recovering | Succeeded | Failed
         | Preempted)
