"""Typed configuration of fault injection: which faults, where, and when they fire.

This is the `chaos:` section of the job spec (`orchestrator.spec.job_spec.JobSpec`). A fault is a
kind, a target (a rank, a node, the controller or the storage path) and a trigger: when
(a training step, or seconds since the job started) and where (a named fault point).
Checks that need other sections (rank < world size, at_step < train.steps) live in the
job spec.

Storage faults (`storage_error`, `storage_latency`, `storage_throttle`, `torn_write`) also say which storage
calls they hit (`op`, `path` glob) and which of those calls fire (`nth`, `probability`);
chaos.storage_faults runs them. Random failures (`mtbf_s` and its companions) are expanded
into timed events by chaos.schedule. Durations accept "30s", "2m", "1h" (chaos.durations).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from chaos.durations import PositiveSeconds, Seconds
from trainer.spec_section import SpecSection

FaultKind = Literal[
    "kill_rank",  # SIGKILL the rank's process
    "kill_node",  # every process Ray runs on a node is SIGKILLed at once (the named node, or `rank`'s)
    "kill_controller",  # the controller SIGKILLs itself; a rerun resumes from the last commit
    "hang_rank",  # the rank stops making progress without dying
    "slow_rank",  # the rank's steps take `factor` times longer (a straggler), or step at_step `delay_s` longer
    "raise",  # the rank raises a Python exception in the training loop
    "nan_grad",  # the rank's gradients become NaN
    "storage_error",  # checkpoint reads/writes fail with an I/O error
    "storage_latency",  # checkpoint reads/writes are delayed by `delay_s`
    "storage_throttle",  # checkpoint reads/writes are refused with S3's 503 SlowDown, as s3fs raises it
    "torn_write",  # a shard write stops half-way (the process dies mid-write)
    "corrupt_shard",  # a committed shard's bytes are flipped after the commit
    "kill_server",  # parallel.mode ps: the supervisor kills parameter server `server` (paramserver.supervisor)
    "hang_server",  # parallel.mode ps: parameter server `server` stops without dying (SIGSTOP)
]

# Kinds that act inside one training rank, so they need to know which one.
RANK_KINDS: frozenset[str] = frozenset({"kill_rank", "hang_rank", "slow_rank", "raise", "nan_grad"})
# Kinds that act on one parameter server (parallel.mode ps), named by `server`.
SERVER_KINDS: frozenset[str] = frozenset({"kill_server", "hang_server"})
TRIGGERS: tuple[str, ...] = ("at_step", "at_seconds", "at_point")
# Kinds that act on checkpoint storage calls (chaos.storage_faults), and the fields only they take.
STORAGE_KINDS: frozenset[str] = frozenset({"storage_error", "storage_latency", "storage_throttle", "torn_write"})
STORAGE_FIELDS: tuple[str, ...] = ("op", "path", "nth", "probability", "when", "keep_fraction", "target")
StorageOp = Literal["write", "read", "list", "delete"]
RandomKind = Literal["kill_node", "kill_rank", "hang_rank"]


# Fields that only some kinds read (the storage fields have their own check: STORAGE_FIELDS).
KIND_FIELDS = {"factor": {"slow_rank"}, "delay_s": {"slow_rank", "storage_latency"}, "node": {"kill_node"},
               "message": {"raise"}}


class FaultSpec(SpecSection):
    """One fault. The chaos injector fires it when its trigger is met: a time (at_step or at_seconds,
    at most one), a place (at_point), or both; a storage fault's selectors (op, path, nth,
    probability) are a trigger of their own.

    `repeat=False` fires once per job (a restarted generation that passes the same step again
    does not re-fire it); `repeat=True` fires every time the trigger is met, which is how a
    crash loop or a flaky storage backend is modelled.
    """

    kind: FaultKind = Field(..., description="what happens: kill_rank, kill_node, kill_controller, hang_rank, "
                            "slow_rank, raise, nan_grad, storage_error, storage_latency, storage_throttle, torn_write, "
                            "corrupt_shard, kill_server, hang_server (FaultKind in chaos/config.py says what each "
                            "does)")
    # validate_default: a rank-level fault with no `rank` key at all must still be reported.
    rank: int | None = Field(None, ge=0, validate_default=True, description="target rank (rank-level kinds)")
    node: str | None = Field(None, min_length=1, description="target node (Ray node id) of a random kill_node; a "
                             "scripted kill_node names the node by a rank it hosts (rank)")
    server: int | None = Field(None, ge=0, validate_default=True, description="kill_server, hang_server: the "
                               "parameter server to kill or stop (0..parallel.servers-1), when every worker has "
                               "pushed at_step steps to it")
    at_step: int | None = Field(None, ge=0, description="fire during this global step")
    at_seconds: Seconds | None = Field(None, description="fire this long after the job starts")
    at_point: str | None = Field(
        None, description="fire at a named point: a rank's (before_step, "
        "after_forward, after_backward, in_allreduce, after_optimizer_step, during_stage, during_shard_write, "
        "during_restore) or, for kill_controller, before_manifest_commit or after_manifest_commit"
    )
    factor: float | None = Field(None, gt=1.0, description="slow_rank: step-time multiplier")
    delay_s: PositiveSeconds | None = Field(None, description="storage_latency: added seconds per I/O call; "
                                    "slow_rank: added seconds in step at_step (each generation's first without it)")
    duration_s: PositiveSeconds | None = Field(None, description="storage faults: how long the errors, latency or "
                                               "throttling last (a slow_rank stays slow from at_step on)")
    message: str = Field("injected fault", description="raise: the injected exception's message")
    repeat: bool = Field(False, description="fire every time the trigger is met (a crash loop, a flaky store), "
                         "not only once per job")
    # Storage kinds only (see chaos.storage_faults for the exact semantics).
    op: StorageOp | None = Field(None, description="storage faults: which calls (default: all)")
    path: str | None = Field(None, min_length=1, description="storage faults: glob on the path, e.g. */manifest.json")
    nth: int | None = Field(None, ge=1, description="storage faults: fire on the nth matching call")
    probability: float | None = Field(None, gt=0.0, le=1.0, description="storage faults: fire with this chance")
    when: Literal["before", "after"] | None = Field(
        None, description="storage_error: fail before the call runs, or after it succeeded (a lost reply)")
    keep_fraction: float | None = Field(None, ge=0.0, lt=1.0, description="torn_write: share of the bytes that land")
    target: Literal["checkpoint", "data"] | None = Field(
        None, description="storage faults: the checkpoint store (default) or data: the ranks' reads of their "
        "prepared training dataset (every rank's, or rank's; from at_seconds, or from the first read once "
        "step at_step begins, for duration_s), which wait an outage out for data.read_retry_s")

    @field_validator("rank", mode="after")
    @classmethod
    def _rank_for_kind(cls, rank: int | None, info: ValidationInfo) -> int | None:
        # `kind` is declared first, so it is in info.data unless it failed its own check.
        kind = info.data.get("kind")
        if kind in RANK_KINDS and rank is None:
            raise ValueError(f"{kind} acts on one rank; add rank: <0..world_size-1>")
        if kind == "kill_controller" and rank is not None:
            raise ValueError("kill_controller targets the controller, not a rank; remove rank")
        return rank

    @field_validator("server", mode="after")
    @classmethod
    def _server_for_kind(cls, server: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("kind")
        if kind in SERVER_KINDS and server is None:
            raise ValueError(f"{kind} acts on one parameter server; add server: <0..parallel.servers-1>")
        if kind is not None and kind not in SERVER_KINDS and server is not None:
            raise ValueError(f"server names the target of kill_server and hang_server only; remove it from this "
                             f"{kind} fault")
        return server

    @field_validator(*STORAGE_FIELDS, mode="after")
    @classmethod
    def _storage_field_for_kind(cls, value: object, info: ValidationInfo) -> object:
        kind = info.data.get("kind")
        if value is None or kind is None:
            return value
        if kind not in STORAGE_KINDS:
            raise ValueError(f"{info.field_name} applies to storage faults ({', '.join(sorted(STORAGE_KINDS))}) "
                             f"only; remove it from this {kind} fault")
        if info.field_name == "when" and kind != "storage_error":
            raise ValueError(f"when applies to storage_error only; remove it from this {kind} fault")
        if info.field_name == "keep_fraction" and kind != "torn_write":
            raise ValueError(f"keep_fraction applies to torn_write only; remove it from this {kind} fault")
        if info.field_name == "op" and kind == "torn_write" and value != "write":
            raise ValueError(f"torn_write tears writes; use op: write, or remove op (got {value!r})")
        if info.field_name == "target" and value == "data" and kind == "torn_write":
            raise ValueError("torn_write tears checkpoint writes; training data is only read: remove target")
        return value

    @model_validator(mode="after")
    def _check_target_and_trigger(self) -> FaultSpec:
        # When: at_step or at_seconds (at most one). Where: at_point, a named fault point
        # inside the step (rank faults default to after_backward). A fault with only
        # at_point fires the first time that point is reached.
        when = [name for name in ("at_step", "at_seconds") if getattr(self, name) is not None]
        if len(when) > 1:
            raise ValueError("give at most one of at_step, at_seconds (at_point may accompany either)")
        # A storage fault's selectors are a trigger of their own: the first matching call.
        selects = self.kind in STORAGE_KINDS and any(getattr(self, f) is not None for f in STORAGE_FIELDS)
        if not when and self.at_point is None and not selects:
            raise ValueError("give a trigger: at_step, at_seconds or at_point")
        if self.nth is not None and self.probability is not None:
            raise ValueError("give at most one of nth, probability")
        if self.kind == "kill_node" and self.node is None and self.rank is None:
            raise ValueError("kill_node needs rank: <r>, to kill the node that hosts rank r")
        if self.kind == "slow_rank" and (self.factor is None) == (self.delay_s is None):
            raise ValueError("slow_rank needs factor: <step-time multiplier above 1, e.g. 3.0> (a straggler) or "
                             "delay_s: <seconds added to step at_step> (a slow first step), not both")
        if self.kind == "storage_latency" and self.delay_s is None:
            raise ValueError("storage_latency needs delay_s: <seconds added to each storage call>")
        if self.target == "data" and (self.at_point is not None or self.op not in (None, "read")
                                      or self.when is not None):
            raise ValueError("a data fault acts on the ranks' data reads from a job second (at_seconds) or a "
                             "step (at_step), for duration_s: remove at_point, when, and any op other than read")
        return self


class ArmedFault(FaultSpec):
    """A fault as the controller arms it and the injectors fire it: its FaultSpec and an `id` (explicit faults are
    numbered by their index in `chaos.faults`, random ones after them: chaos.schedule), which names the fault in
    every notice (a FaultFired message) and in the controller's record of what fired."""

    id: int = Field(ge=0)

    @classmethod
    def of(cls, spec: FaultSpec, fault_id: int) -> ArmedFault:
        return cls(**spec.model_dump(), id=fault_id)


def rank_storage_faults(faults: Iterable[ArmedFault], rank: int, *, restore: bool) -> list[ArmedFault]:
    """Rank `rank`'s checkpoint storage faults: with `restore`, those with `op: read`, which act on the
    reads of its restores (orchestrator.rank.state); without, the others, which act on its checkpoint
    writer's storage (orchestrator.rank.loop)."""
    return [f for f in faults if f.kind in STORAGE_KINDS and f.target != "data" and f.rank == rank
            and (f.op == "read") == restore]


def rank_data_faults(faults: Iterable[ArmedFault], rank: int) -> list[ArmedFault]:
    """The faults on rank `rank`'s training data reads: `target: data`, with its rank or none (every rank)."""
    return [f for f in faults if f.kind in STORAGE_KINDS and f.target == "data" and f.rank in (None, rank)]


def as_armed(fault: FaultSpec | Mapping, index: int) -> ArmedFault:
    """`fault` as an ArmedFault: one already is; a FaultSpec gets id `index`; a mapping (written by
    hand, as tests and tools do) is validated as a FaultSpec and keeps its own "id" if it has one."""
    if isinstance(fault, ArmedFault):
        return fault
    if isinstance(fault, FaultSpec):
        return ArmedFault.of(fault, index)
    data = dict(fault)
    fault_id = data.pop("id", index)
    return ArmedFault.of(FaultSpec.model_validate(data), fault_id)


_RANDOM_FIELDS = ("mtbf_kind", "mtbf_start_s", "mtbf_max_faults")


MIN_MTBF_S = 1.0  # chaos.mtbf_s per target at the least: a day of failures is drawn at placement (chaos.schedule)


class ChaosConfig(SpecSection):
    """Faults to inject: a scripted list, plus optional random failures.

    With `mtbf_s` set, every target (each node for `mtbf_kind: kill_node`, each rank for the
    rank kinds) fails independently as a Poisson process with that mean time between
    failures, so the whole job sees failures every `mtbf_s / targets` seconds on average
    (docs/design.md section 1). Times and targets are drawn from generators seeded with `seed`,
    so an experiment replays exactly (chaos.schedule.expand).
    """

    faults: list[FaultSpec] = Field(default_factory=list, description="scripted faults, each with a trigger "
                                    "(at_step or at_seconds, and/or at_point; storage faults: their selectors)")
    mtbf_s: PositiveSeconds | None = Field(None, description="random failures: mean time between failures per target")
    mtbf_kind: RandomKind = Field("kill_node", description="random failures: what fails; when this key is "
                                 "absent, `undying chaos` without --kind uses kill_rank on a one-node cluster "
                                 "(a node kill there would kill the controller)")
    mtbf_start_s: Seconds = Field(0.0, description="random failures: none before this many job seconds")
    mtbf_max_faults: int | None = Field(None, ge=1, description="random failures: at most this many")
    seed: int = Field(0, description="seed of the random failures' times and targets (they replay exactly; the "
                      "step a timed fault meets depends on the run's own start-up and recoveries)")

    @field_validator("mtbf_s", mode="after")
    @classmethod
    def _mtbf_s_at_least_a_second(cls, value: float | None) -> float | None:
        if value is not None and value < MIN_MTBF_S:
            raise ValueError(f"{value:g} s is below {MIN_MTBF_S:g} s per target: a failure that often leaves no step "
                             f"to train; give at least '{MIN_MTBF_S:g}s'")
        return value

    @field_validator(*_RANDOM_FIELDS, mode="after")
    @classmethod
    def _random_fields_need_mtbf(cls, value: object, info: ValidationInfo) -> object:
        # Runs only for keys given, and a dumped spec gives every key: its defaults are fine.
        # mtbf_s is declared first, so it is in info.data unless invalid (reported on its own).
        default = cls.model_fields[info.field_name].default
        if value != default and "mtbf_s" in info.data and info.data["mtbf_s"] is None:
            raise ValueError(f"{info.field_name} only shapes random failures, which need mtbf_s; "
                             "set mtbf_s (e.g. '30m') or remove it")
        return value


# What a job may ask for: every kind the orchestrator wires to an injector. Rank kinds and
# nan_grad fire in the rank's FaultInjector (chaos.injector); storage kinds are installed on a
# Storage (chaos.storage_faults): with `rank: r` on the one rank r's shard writer uses (op: write
# or none) or on the one its restore reads through (op: read), without `rank` on the controller's
# catalog Storage (manifest commits, listings, deletes, its manifest reads and verifications);
# corrupt_shard is fired by the controller right after a commit (chaos.corrupt);
# kill_controller by the controller on itself (orchestrator.controller.kill); kill_server and
# hang_server by the parameter-server supervisor (paramserver.supervisor; the job spec refuses them
# outside parallel.mode ps).
INJECTABLE_KINDS: frozenset[str] = frozenset({
    "kill_rank", "kill_node", "kill_controller", "hang_rank", "slow_rank", "raise", "nan_grad",
    "storage_error", "storage_latency", "storage_throttle", "torn_write", "corrupt_shard", "kill_server",
    "hang_server"})
# What the chaos library itself can inject (chaos.injector, chaos.storage_faults, chaos.corrupt).
LIBRARY_KINDS: frozenset[str] = INJECTABLE_KINDS
# Kinds the controller can fire at a time (explicit at_seconds, random mtbf_s failures). Storage
# faults take at_seconds too, with another meaning: the start of the window they are active in.
TIMED_KINDS: frozenset[str] = frozenset({"kill_rank", "kill_node", "hang_rank"})
# Named fault points on a rank: the engine's, per training step (in_allreduce: the step's DDP
# gradient all-reduce is in flight), the checkpoint writer's, per save, and the restore's, per load
# (at_step names the checkpoint's step at the last two).
RANK_POINTS: tuple[str, ...] = (
    "before_step", "after_forward", "after_backward", "in_allreduce", "after_optimizer_step",
    "during_stage", "during_shard_write", "during_restore",
)
# Named fault points in the controller, per commit (at_step: the first checkpoint committed at or
# after that step): only controller faults fire there.
CONTROLLER_POINTS: tuple[str, ...] = ("before_manifest_commit", "after_manifest_commit")
FAULT_POINTS: tuple[str, ...] = RANK_POINTS + CONTROLLER_POINTS
# Points where at_step names a checkpoint's step, which may be the final save (train.steps).
CHECKPOINT_POINTS: frozenset[str] = frozenset({"during_stage", "during_shard_write", "during_restore",
                                               *CONTROLLER_POINTS})


def support_problems(chaos: ChaosConfig) -> list[tuple[str, str]]:
    """(field, message) for each configured fault this release cannot inject as written.

    Triggers each kind accepts (FaultSpec already demands at least one):
      kill_rank, hang_rank   at_step, at_point (a FAULT_POINT), at_seconds (fired by the controller)
      kill_node              the same, and needs rank: the rank's own process kills its node
      raise, slow_rank       at_step, at_point
      nan_grad               at_step; at_point only after_backward (the gradients exist only there)
      storage kinds          at_step (that checkpoint's directory), at_seconds + duration_s (a window of
                             job seconds; duration_s alone: from the first call it matches), op / path /
                             nth / probability; with rank, op: write (its shard writes) or op: read (its
                             restore reads, not at_seconds: a restore's time is not known in advance);
                             with target: data, the ranks' training data reads (at_seconds or at_step,
                             duration_s)
      corrupt_shard          at_step only: the first checkpoint committed at or after that step, once
      kill_controller        at_step (the controller learns that step finished), at_point (a CONTROLLER_POINT,
                             optionally with at_step: the first commit at or after it); once per job
    Rank kinds take RANK_POINTS only, kill_controller CONTROLLER_POINTS only.
    """
    out = []
    for i, fault in enumerate(chaos.faults):
        problem = _fault_problem(fault)
        if problem is not None:
            out.append((f"chaos.faults[{i}].{problem[0]}", problem[1]))
    return out


def _fault_problem(fault: FaultSpec) -> tuple[str, str] | None:
    kind = fault.kind
    if kind not in INJECTABLE_KINDS:
        return "kind", f"{kind} cannot be injected by this release; use one of {', '.join(sorted(INJECTABLE_KINDS))}"
    # A field the kind never reads would be ignored in silence: the experiment the spec describes
    # would not be the one that runs. (Set: not its default, since copies pass every field on.)
    for name, kinds in KIND_FIELDS.items():
        if getattr(fault, name) != FaultSpec.model_fields[name].default and kind not in kinds:
            return name, (f"{name} applies to {' and '.join(sorted(kinds))} faults only; remove {name} from this "
                          f"{kind} fault")
    if kind == "corrupt_shard":
        return _corrupt_problem(fault)
    if kind == "kill_controller":
        return _kill_controller_problem(fault)
    if kind in STORAGE_KINDS:
        if fault.target == "data":  # checked whole by FaultSpec: the ranks' data reads in a job-second window
            return None
        if fault.at_point is not None:
            return "at_point", (f"{kind} is selected by op, path, nth, probability, at_step or at_seconds, not by a "
                                "fault point; remove at_point")
        if fault.rank is not None and fault.op not in (None, "write", "read"):
            return "op", (f"{kind} with rank acts on that rank's shard writes (op: write) or restore reads (op: read); "
                          "use one of them, or remove rank to act on the controller's storage (manifests, listings, "
                          "deletes, reads)")
        if fault.rank is not None and fault.op == "read" and fault.at_seconds is not None:
            return "at_seconds", (f"{kind} on a rank's restore reads cannot start at a job second (when a restore "
                                  "happens is not known in advance); remove at_seconds: with duration_s the fault "
                                  "lasts that long from the first read it matches")
        return None
    if fault.duration_s is not None:
        return "duration_s", f"duration_s shapes storage faults only; remove it from this {kind} fault"
    if fault.at_point in CONTROLLER_POINTS:
        return "at_point", (f"{fault.at_point} is a point in the controller, where only kill_controller fires; "
                            f"give this {kind} fault a rank point: {', '.join(RANK_POINTS)}")
    if fault.at_point is not None and fault.at_point not in RANK_POINTS:
        close = difflib.get_close_matches(fault.at_point.lower(), RANK_POINTS, n=1)
        return "at_point", (f"unknown fault point {fault.at_point!r}" + (f" (did you mean {close[0]!r}?)" if close
                            else "") + f"; use one of {', '.join(RANK_POINTS)}")
    if kind == "nan_grad" and fault.at_point not in (None, "after_backward"):
        return "at_point", ("nan_grad poisons gradients, which exist only after the backward; use at_point: "
                            "after_backward or remove at_point")
    if kind == "kill_node" and (fault.rank is None or fault.node is not None):
        return "node", ("kill_node is injected by a rank on the node: give rank: <r> to kill the node that hosts "
                        "rank r" + (", and remove node" if fault.node is not None else ""))
    if fault.at_seconds is not None and kind not in TIMED_KINDS:
        return "at_seconds", (f"time-triggered {kind} is not supported; use at_step, or one of "
                              f"{', '.join(sorted(TIMED_KINDS))}")
    return None


def _corrupt_problem(fault: FaultSpec) -> tuple[str, str] | None:
    # The controller corrupts a checkpoint it has just committed: a step is the only trigger.
    for name in ("rank", "at_point", "at_seconds", "duration_s"):
        if getattr(fault, name) is not None:
            return name, (f"corrupt_shard is fired by the controller after a commit; remove {name} and give "
                          "at_step: <k> (the first checkpoint committed at or after step k)")
    if fault.at_step is None:
        return "at_step", "corrupt_shard needs at_step: <k> (the first checkpoint committed at or after step k)"
    if fault.repeat:
        return "repeat", "corrupt_shard corrupts one checkpoint; remove repeat"
    return None


def _kill_controller_problem(fault: FaultSpec) -> tuple[str, str] | None:
    # The controller fires it on itself: at a step it learns of, or at one of its own points.
    if fault.at_point is not None and fault.at_point not in CONTROLLER_POINTS:
        where = "a rank point" if fault.at_point in RANK_POINTS else f"an unknown point {fault.at_point!r}"
        return "at_point", (f"kill_controller fires in the controller, not at {where}; use at_point: "
                            f"{' or '.join(CONTROLLER_POINTS)}, or only at_step: <k>")
    for name in ("node", "at_seconds", "duration_s"):
        if getattr(fault, name) is not None:
            return name, (f"kill_controller is triggered by at_step or at_point ({', '.join(CONTROLLER_POINTS)}); "
                          f"remove {name}")
    if fault.repeat:
        return "repeat", ("kill_controller fires once per job (a rerun that fired it again would never finish); "
                          "remove repeat")
    return None
