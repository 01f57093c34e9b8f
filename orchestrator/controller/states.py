"""The controller's states and the record of a failure it is handling (see orchestrator.controller.machine)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class State(str, Enum):
    PLACING = "PLACING"
    RENDEZVOUS = "RENDEZVOUS"
    RESTORING = "RESTORING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


TERMINAL = (State.SUCCEEDED, State.FAILED)


@dataclass
class Failure:
    kind: str
    rank: int | None
    detected_at: float  # time.time() when the controller noticed
    message: str
    fault_time: float | None = None  # time.time() an injected fault fired, when known
    step: int | None = None  # the step being computed when it failed
