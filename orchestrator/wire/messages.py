"""Every message between the ranks and the controller, typed, with its JSON form.

Ranks push events to the controller through the generation's store queue
(orchestrator.wire.store: `send` / `receive`); the controller publishes one
checkpoint plan under the `plan` key, which ranks poll. Who sends what:

    message          type         sender                         when
    StepDone         "step"       rank 0                         after every step (global loss)
    ShardWritten     "receipt"    every rank (writer thread)     its shard of a save is durable
    SnapshotHeld     "snapshot"   every rank (memory writer)     its memory snapshot shard is held twice
    SaveFailed       "save_error" every rank (writer thread)     its shard could not be written
    FaultFired       "fault"      a rank or the controller       an injected fault fires, before it acts
    NodeLost         "node_lost"  every rank (node watchdog)     its raylet is gone
    MemoryReport     "memory"     rank 0                         after a generation's first step
    EvalDone         "eval"       rank 0                         after each validation (eval.every_steps)
    Heartbeat        (a key)      every rank                     at most every monitor.heartbeat_s
    CheckpointPlan   (a key)      the controller                 at restore, and when the cadence moves

Events are queued; a heartbeat (`hb/<rank>`) and the plan (`plan`) are keys, the newest value
overwriting the last. `encode(message)` gives the JSON-ready dict (with its "type"), `decode(dict)` the message;
`MESSAGES` is the dispatch table between the two. The bytes on the wire are that JSON, sealed
with the job's secret (orchestrator.wire.auth: a value without a valid tag is dropped).
Fault notices are built by the chaos library (chaos.injector, chaos.storage_rules), which
sits below this module, as dicts of FaultFired's fields; the rank decodes them before
sending, so a malformed notice fails where it is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from ckpt.manifest import ShardReceipt


@dataclass(frozen=True)
class StepDone:
    type: ClassVar[str] = "step"
    step: int
    loss: float
    tokens: int
    step_s: float
    time: float
    compute_s: float = 0.0
    grad_norm: float | None = None
    lr: float | None = None
    bubble: float | None = None  # measured idle fraction of rank 0's pipeline stage (pp > 1)
    loss_scale: float = 1.0  # fp16's dynamic loss scale; 1.0 when training unscaled
    data_wait_s: float = 0.0  # how long rank 0's step waited for its samples


@dataclass(frozen=True)
class ShardWritten:
    type: ClassVar[str] = "receipt"
    receipt: ShardReceipt
    # rank 0: {"engine": the engine's state metadata}; the first rank of each dp replica (tp and pp
    # rank 0): {"samples": [first_step, end_step, count, digest]} of the samples it consumed since
    # its generation's restore (trainer.batch.SampleDigest), the exactly-once evidence.
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"receipt": self.receipt.model_dump(), "extra": self.extra}

    @classmethod
    def from_json(cls, data: dict) -> ShardWritten:
        return cls(ShardReceipt.model_validate(data["receipt"]), dict(data.get("extra") or {}))


@dataclass(frozen=True)
class SnapshotHeld:
    """A rank's shard of a memory snapshot is in its own memory and in its buddy's: `holders` are the
    Ray actor ids of the processes holding the file (the owner first). `extra` as in ShardWritten."""

    type: ClassVar[str] = "snapshot"
    receipt: ShardReceipt
    holders: list[str]
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"receipt": self.receipt.model_dump(), "holders": list(self.holders), "extra": self.extra}

    @classmethod
    def from_json(cls, data: dict) -> SnapshotHeld:
        return cls(ShardReceipt.model_validate(data["receipt"]), [str(h) for h in data["holders"]],
                   dict(data.get("extra") or {}))


@dataclass(frozen=True)
class SaveFailed:
    type: ClassVar[str] = "save_error"
    rank: int
    step: int
    error: str


@dataclass
class FaultFired:
    """An injected fault fired. Rank faults name (rank, step, point); storage faults (op, path, mode);
    corrupt_shard the committed `step` and a `detail`. `handled` is the controller's own mark
    (the fault was blamed for a failure, or can make none: storage, corruption); it never
    travels: `to_json` leaves it out and `from_json` starts every notice unhandled."""

    type: ClassVar[str] = "fault"
    fault_id: int
    kind: str
    time: float | None = None
    rank: int | None = None
    step: int | None = None
    point: str | None = None
    op: str | None = None
    path: str | None = None
    mode: str | None = None
    detail: str | None = None
    handled: bool = False

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "handled"}

    @classmethod
    def from_json(cls, data: dict) -> FaultFired:
        return _build(cls, {k: v for k, v in data.items() if k != "handled"})


@dataclass(frozen=True)
class EvalDone:
    type: ClassVar[str] = "eval"
    step: int  # the model after this many steps (the eval ran once step - 1 finished)
    loss: float  # summed token cross-entropy / tokens (trainer.evaluation)
    tokens: int
    seconds: float  # wall time of the evaluation on rank 0


@dataclass(frozen=True)
class NodeLost:
    type: ClassVar[str] = "node_lost"
    node: str
    rank: int
    time: float


@dataclass(frozen=True)
class MemoryReport:
    type: ClassVar[str] = "memory"
    ledgers: dict | None  # measured bytes per memory ledger (trainer.memory_probe); None where unmeasurable


Message = StepDone | ShardWritten | SnapshotHeld | SaveFailed | FaultFired | NodeLost | MemoryReport | EvalDone
MESSAGES: dict[str, type] = {m.type: m for m in (StepDone, ShardWritten, SnapshotHeld, SaveFailed, FaultFired,
                                                 NodeLost, MemoryReport, EvalDone)}


def encode(message: Message) -> dict[str, Any]:
    body = message.to_json() if hasattr(message, "to_json") else asdict(message)
    return {"type": message.type, **body}


def decode(data: dict[str, Any]) -> Message:
    """The message a JSON event holds; ValueError naming the type or field when it is not one (only
    ValueError: a sealed event of another release, or of a bug, is skipped by its reader, never raised
    through the controller's intake)."""
    kind = data.get("type")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}; known: {sorted(MESSAGES)}")
    body = {k: v for k, v in data.items() if k != "type"}
    return _parsed(kind, lambda: cls.from_json(body) if hasattr(cls, "from_json") else _build(cls, body))


def _parsed(what: str, parse: Callable[[], Any]) -> Any:
    """`parse()`, its missing or mistyped fields (KeyError, TypeError, AttributeError) a ValueError naming `what`."""
    try:
        return parse()
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{what} event: {type(err).__name__}: {err}") from None


def _build(cls: type, body: dict[str, Any]) -> Message:
    """`cls(**body)`, with a ValueError naming the event type and the field when it does not fit."""
    unknown = sorted(set(body) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{cls.type} event: unknown field(s) {unknown}")
    try:
        return cls(**body)
    except TypeError as err:
        raise ValueError(f"{cls.type} event: {err}") from None


@dataclass(frozen=True)
class Heartbeat:
    """A rank's latest heartbeat: the step it finished, when, and its mean compute time per step
    since its previous heartbeat (the straggler detector's input).

    While the rank's training thread is blocked on a checkpoint save (waiting for the one in
    flight, or at a stop or the final step until its shard is written) it keeps beating: `saving`
    is the step of the newest save it asked for (None while training; it may be waiting behind the
    one before) and `saved_bytes` the bytes its writers have
    handed to the store so far, over the generation. The controller's hang watchdog counts such a
    rank as busy while it beats and its bytes move (orchestrator.controller.telemetry). Likewise
    while it waits for a step's data (reads its store may be failing, retried for up to
    `data.read_retry_s`): `data_wait_s` is how long that wait has lasted (0 otherwise)."""

    step: int
    time: float
    compute_s: float
    saving: int | None = None
    saved_bytes: int = 0
    data_wait_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Heartbeat:
        """ValueError when `data` is not one (decode's)."""
        saving = data.get("saving") if isinstance(data, dict) else None
        return _parsed("heartbeat", lambda: cls(
            int(data["step"]), float(data["time"]), float(data["compute_s"]), None if saving is None else int(saving),
            int(data.get("saved_bytes", 0)), float(data.get("data_wait_s", 0.0))))


@dataclass(frozen=True)
class CheckpointPlan:
    """Which completed steps a rank checkpoints at, published by the controller under `plan`.

    A save happens after completed step `s` when `s > anchor` and `(s - anchor) % every == 0`,
    and always at the final step. `stop_at` (preemption, a node drain) ends the generation:
    each rank saves at that completed step and its `train` call returns there (ranks that all
    read it late, already past it, save and return at the step they reached; one alone past it
    is held in its next step's collective by the ranks that stopped, until the stop misses its
    deadline and the abort frees it: orchestrator.controller.stopping). Ranks read the plan at every
    step boundary; otherwise they may pick up a new plan at slightly different steps.
    That is safe by construction: the controller commits a checkpoint only when every rank's
    receipt for that step is in, so a step that only some ranks saved is never committed; its
    shards are garbage. The controller sets `anchor` ahead of the fastest rank so this is rare.
    """

    every: int
    anchor: int = 0
    version: int = 0
    final_step: int | None = None
    tag: str = ""  # save attempt (controller run + generation), in shard file names
    # Epoch seconds at job second 0 (the goodput ledger's clock, carried across resumes), so
    # that a rank's storage faults read `at_seconds` and `duration_s` as job seconds.
    job_started_at: float | None = None
    stop_at: int | None = None  # the generation's last step, checkpointed (None: train to the end)
    # The memory level's cadence (None: off): a snapshot after completed step s when s > m and
    # (s - m) % memory_every == 0, with m = memory_anchor (None: anchor), never at the final step
    # nor at a stop step (storage saves those, and the ranks' return must not wait for a buddy's
    # copy past the stop's deadline). An anchor of its own lets the memory cadence move while the storage
    # saves stay on their steps (every_steps: 10 saves at 10, 20, 30, ...).
    memory_every: int | None = None
    memory_anchor: int | None = None
    # The newest memory snapshot the controller has whole: every holder keeps its files (ckpt.held)
    # while newer ones are still being copied, since a restore would choose it.
    memory_complete: int | None = None

    def stops(self, completed: int) -> bool:
        return self.stop_at is not None and completed >= self.stop_at

    def should_save(self, completed: int) -> bool:
        if self.final_step is not None and completed == self.final_step:
            return True
        return completed > self.anchor and (completed - self.anchor) % self.every == 0

    def snapshot_due(self, completed: int) -> bool:
        if self.memory_every is None or completed == self.final_step or self.stops(completed):
            return False
        anchor = self.anchor if self.memory_anchor is None else self.memory_anchor
        return completed > anchor and (completed - anchor) % self.memory_every == 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CheckpointPlan:
        """ValueError when `data` is not one (decode's)."""
        return _parsed("plan", lambda: cls(**data))
