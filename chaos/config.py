"""Typed configuration of fault injection: which faults, where, and when they fire.

This is the `chaos:` section of the job spec (`orchestrator.spec.JobSpec`). A fault is a
kind, a target (a rank, a node, the controller or the storage path) and a trigger: when
(a training step, or seconds since the job started) and where (a named fault point).
Checks that need other sections (rank < world size, at_step < train.steps) live in the
job spec.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

FaultKind = Literal[
    "kill_rank",  # SIGKILL the rank's process
    "kill_node",  # kill every process on a node (the named node, or the node that hosts `rank`)
    "kill_controller",  # kill the controller; ranks must survive and be re-adopted
    "hang_rank",  # the rank stops making progress without dying
    "slow_rank",  # the rank's steps take `factor` times longer (a straggler)
    "raise",  # the rank raises a Python exception in the training loop
    "nan_grad",  # the rank's gradients become NaN
    "storage_error",  # checkpoint reads/writes fail with an I/O error
    "storage_latency",  # checkpoint reads/writes are delayed by `delay_s`
    "torn_write",  # a shard write stops half-way (the process dies mid-write)
    "corrupt_shard",  # a committed shard's bytes are flipped after the commit
]

# Kinds that act inside one training rank, so they need to know which one.
RANK_KINDS: frozenset[str] = frozenset({"kill_rank", "hang_rank", "slow_rank", "raise", "nan_grad"})
TRIGGERS: tuple[str, ...] = ("at_step", "at_seconds", "at_point")


class _Strict(BaseModel):
    # Unknown keys are user mistakes (a typo silently ignored is a fault never injected).
    model_config = ConfigDict(extra="forbid", frozen=True)


class FaultSpec(_Strict):
    """One fault. The chaos injector fires it when its single trigger is met.

    `repeat=False` fires once per job (a restarted generation that passes the same step again
    does not re-fire it); `repeat=True` fires every time the trigger is met, which is how a
    crash loop or a flaky storage backend is modelled.
    """

    kind: FaultKind
    # validate_default: a rank-level fault with no `rank` key at all must still be reported.
    rank: int | None = Field(None, ge=0, validate_default=True, description="target rank (rank-level kinds)")
    node: str | None = Field(None, min_length=1, description="target node (Ray node id or IP)")
    at_step: int | None = Field(None, ge=0, description="fire during this global step")
    at_seconds: float | None = Field(None, ge=0.0, description="fire this long after the job starts")
    at_point: str | None = Field(
        None, pattern=r"^[a-z0-9_]+(\.[a-z0-9_]+)*$", description="fire at a named point, e.g. ckpt.commit"
    )
    factor: float | None = Field(None, gt=1.0, description="slow_rank: step-time multiplier")
    delay_s: float | None = Field(None, gt=0.0, description="storage_latency: added seconds per I/O call")
    duration_s: float | None = Field(None, gt=0.0, description="how long a slow/latency/error fault lasts")
    message: str = Field("injected fault", description="raise: the injected exception's message")
    repeat: bool = False

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

    @model_validator(mode="after")
    def _check_target_and_trigger(self) -> FaultSpec:
        # When: at_step or at_seconds (at most one). Where: at_point, a named fault point
        # inside the step (rank faults default to after_backward). A fault with only
        # at_point fires the first time that point is reached.
        when = [name for name in ("at_step", "at_seconds") if getattr(self, name) is not None]
        if len(when) > 1:
            raise ValueError("give at most one of at_step, at_seconds (at_point may accompany either)")
        if not when and self.at_point is None:
            raise ValueError("give a trigger: at_step, at_seconds or at_point")
        if self.kind == "kill_node" and self.node is None and self.rank is None:
            raise ValueError("kill_node needs node: <node id or IP>, or rank: <r> to kill the node hosting r")
        if self.kind == "slow_rank" and self.factor is None:
            raise ValueError("slow_rank needs factor: <step-time multiplier above 1, e.g. 3.0>")
        if self.kind == "storage_latency" and self.delay_s is None:
            raise ValueError("storage_latency needs delay_s: <seconds added to each storage call>")
        return self


class ChaosConfig(_Strict):
    """Faults to inject: a scripted list, plus optional random rank kills.

    With `mtbf_s` set, a rank chosen at random is killed at exponentially distributed
    intervals with that mean, drawn from a generator seeded with `seed` so that an
    experiment can be replayed.
    """

    faults: list[FaultSpec] = Field(default_factory=list)
    mtbf_s: float | None = Field(None, gt=0.0, description="mean time between random rank kills")
    seed: int = 0


# What the rank-side injector of this release can fire; the others are accepted by the
# spec's grammar but refused before any rank starts, so nobody believes a fault ran.
INJECTABLE_KINDS: frozenset[str] = frozenset({"kill_rank", "hang_rank", "slow_rank", "raise"})
# Named fault points: the engine's, per training step, and the checkpoint writer's, per save
# (where at_step names the checkpoint's step).
FAULT_POINTS: tuple[str, ...] = (
    "before_step", "after_forward", "after_backward", "after_optimizer_step", "during_stage", "during_shard_write",
)


def support_problems(chaos: ChaosConfig) -> list[tuple[str, str]]:
    """(field, message) for each configured fault this release cannot inject."""
    out = []
    for i, fault in enumerate(chaos.faults):
        if fault.kind not in INJECTABLE_KINDS:
            out.append((f"chaos.faults[{i}].kind", f"{fault.kind} cannot be injected by this release; "
                        f"use one of {', '.join(sorted(INJECTABLE_KINDS))}"))
        elif fault.at_point is not None and fault.at_point not in FAULT_POINTS:
            out.append((f"chaos.faults[{i}].at_point", f"unknown fault point {fault.at_point!r}; use one of "
                        f"{', '.join(FAULT_POINTS)}"))
        elif fault.at_seconds is not None:
            out.append((f"chaos.faults[{i}].at_seconds", "time-triggered faults are not supported by this "
                        "release; use at_step"))
    if chaos.mtbf_s is not None:
        out.append(("chaos.mtbf_s", "random (Poisson) failures are not supported by this release; "
                    "list faults explicitly"))
    return out
