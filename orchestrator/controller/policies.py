"""Policies decide; only the controller acts (docs/design.md section 2).

Each policy is a small object with pure decision methods, injected into the controller so
unit tests can drive one transition at a time and swap a policy for a fake.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ckpt.config import CheckpointConfig
from ckpt.interval import IntervalInputs, MtbfEstimate, steps_for_interval


@dataclass(frozen=True)
class FailureDecision:
    class Action(str, Enum):
        RESTART = "restart"
        FAIL = "fail"

    action: Action
    reason: str


@dataclass(frozen=True)
class FailureSummary:
    """What the failure policy needs to know of one failure."""

    kind: str
    rank: int | None
    step: int | None  # the step the job was computing when it failed
    error: str  # normalised exception text (see orchestrator.controller.errors.normalise)
    at: float  # time.time() when the controller noticed it: the restart window counts by it
    injected_machine_fault: bool = False  # a process, node or hang chaos injected (not a simulated bug)
    earlier_run: bool = False  # an earlier run of the job's (orchestrator.controller.failure_carry)


class FailurePolicy:
    """Restart after a failure until `max_restarts` is spent within `window_s`, then fail the job.

    The budget is a rolling window (systemd's StartLimitBurst per StartLimitIntervalSec): the
    restarts of the failures noticed in the last `window_s` seconds count. A multi-day job on a
    large cluster fails every few hours as a matter of course (Llama 3: one every ~3 h), and a
    budget for the whole run would end a healthy job on its eleventh day-old failure, while a
    burst of failures (a bad node pool, a store outage) still spends the budget and stops it.
    `window_s` None counts every failure. The history holds the job's earlier runs' failures too
    (orchestrator.controller.failure_carry): a rerun does not renew the budget.

    A crash loop, the same error on the same rank at the same step `crash_loop_limit` times
    in a row, fails the job at once: restarting deterministic training on the same data
    would only fail again, and the user needs the step, rank and exception, not a spent budget.
    Injected machine faults (a killed process or node, a stopped rank) are never a crash loop: a
    chaos experiment whose kills land faster than the job recovers (the same rank killed at the
    same step again and again) spends its restarts, and the message says that budget, not a bug
    in the job. An injected exception or NaN stands for a bug, and is one.
    """

    def __init__(self, max_restarts: int, crash_loop_limit: int = 3, window_s: float | None = None):
        self.max_restarts = max_restarts
        self.crash_loop_limit = crash_loop_limit
        self.window_s = window_s

    @classmethod
    def for_spec(cls, spec) -> FailurePolicy:
        elastic = spec.elastic
        return cls(elastic.max_restarts, elastic.crash_loop_limit, elastic.restart_window_s)

    def decide(self, history: list[FailureSummary]) -> FailureDecision:
        last = history[-1]
        same = 0
        for failure in reversed(history):
            if _loop_key(failure) != _loop_key(last):
                break
            same += 1
        if last.step is not None and not last.injected_machine_fault and same >= self.crash_loop_limit:
            who = "every rank" if _every_rank(last.error) else f"rank {last.rank}"
            return FailureDecision(FailureDecision.Action.FAIL,
                                   f"crash loop: {who} failed at step {last.step} {same} times in a row with "
                                   f"{last.error}" + (NON_FINITE_HINT if _every_rank(last.error) else ""))
        # Every earlier failure was restarted (a failure the policy fails ends the job), by this run
        # or by an earlier run of the job: a rerun does not renew the budget.
        counted = [f for f in history[:-1] if self.window_s is None or f.at > last.at - self.window_s]
        restarts_so_far, earlier = len(counted), sum(f.earlier_run for f in counted)
        within = ("" if self.window_s is None else f" in the last {_duration(self.window_s)}") + (
            f" ({earlier} by earlier runs of this job)" if earlier else "")
        if restarts_so_far >= self.max_restarts:
            budget = f"elastic.max_restarts={self.max_restarts}" + (
                "" if self.window_s is None else f" per elastic.restart_window_s={self.window_s:g}")
            return FailureDecision(FailureDecision.Action.FAIL, f"{restarts_so_far} restarts used{within}, {budget}")
        return FailureDecision(FailureDecision.Action.RESTART,
                               f"restart {restarts_so_far + 1} of {self.max_restarts}{within}")


def _duration(seconds: float) -> str:
    """A window in the unit a person would say it in: 86400 -> "24 h", 600 -> "10 min"."""
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


# Errors every rank raises at once: the gradient norm and fp16's overflow flag are all-reduced, so a
# non-finite norm or a loss scale run out fails them all together, and which rank the controller
# hears first (the one blamed) is chance.
EVERY_RANK_ERRORS = ("NonFiniteGradient:", "LossScaleExhausted:")
NON_FINITE_HINT = ("; replayed from a checkpoint, the step is computed again exactly as before, so the "
                   "cause is its data or the hyperparameters, not a fault: look at that step's samples, lower "
                   "train.lr or lengthen train.warmup_steps")


def _every_rank(error: str) -> bool:
    return (error or "").startswith(EVERY_RANK_ERRORS)


def _loop_key(failure: FailureSummary) -> tuple:
    """What repeats in a crash loop: the rank, the step and the error's shape; for an error every rank
    raises, the step and its exception's name alone (its text names the rank, and a rank number of
    another length moves where the normalised text is cut)."""
    if _every_rank(failure.error):
        return None, failure.step, failure.error.split(":", 1)[0]
    return failure.rank, failure.step, _shape(failure.error)


def _shape(error: str) -> str:
    """The error without its numbers: a hang's message says how long it waited ("no step for 61.3 s"),
    which differs at every repeat of the same hang and must not hide a crash loop."""
    return _NUMBER.sub("#", error or "")


class ScalingPolicy:
    """Which data-parallel degree to run with when ranks are lost or come back.

    Tensor and pipeline degrees are fixed by the model; only dp changes. A degree is valid
    when it is at least `min_dp` and nothing else refuses it (`refusal(dp)`, for a job
    orchestrator.spec.elastic.dp_refusal: whole HSDP replicas, which shard the state among them
    and are dropped or added together, and a layout the engine takes, among it a global batch of
    whole microbatches per rank): the global batch stays constant and gradient accumulation
    absorbs the difference, so the loss trajectory does not depend on failures (with
    model.dropout 0: masks are drawn per rank and microbatch slot, docs/design.md).
    """

    def __init__(self, target_dp: int, min_dp: int, model_parallel: int = 1,
                 refusal: Callable[[int], str | None] = lambda dp: None):
        """`refusal(dp)`: what rules dp out besides min_dp, naming its field; None when nothing does."""
        self.target_dp = target_dp
        self.min_dp = min_dp
        self.model_parallel = model_parallel  # tp * pp ranks per data-parallel replica
        self.refusal = refusal

    @classmethod
    def for_spec(cls, spec) -> ScalingPolicy:
        from orchestrator.spec.elastic import dp_refusal

        par = spec.parallel
        return cls(par.dp, spec.elastic.min_dp, par.tp * par.pp, lambda dp: dp_refusal(spec, dp))

    def valid(self, dp: int) -> bool:
        return dp >= self.min_dp and self.refusal(dp) is None

    def best_dp(self, ranks_available: int) -> int | None:
        """The largest valid dp that `ranks_available` ranks can hold, capped at the target."""
        return next((dp for dp in range(self._top(ranks_available), 0, -1) if self.valid(dp)), None)

    def _top(self, ranks_available: int) -> int:
        return min(self.target_dp, ranks_available // self.model_parallel)

    def no_dp_because(self, ranks_available: int) -> str:
        """Why `best_dp(ranks_available)` is None, naming the fields that decide it."""
        top = self._top(ranks_available)
        if top < self.min_dp:
            return f"{ranks_available} rank(s) hold dp {top}, below elastic.min_dp={self.min_dp}"
        tried = range(top, self.min_dp - 1, -1)
        why = "; ".join(f"dp {dp}: {self.refusal(dp)}" for dp in tried[:3]) + ("; ..." if len(tried) > 3 else "")
        return f"no dp from {top} down to elastic.min_dp={self.min_dp} works ({why})"


class CheckpointIntervalPolicy:
    """How many steps between checkpoints, by the spec's cadence rule (ckpt.config.CheckpointConfig).

    Fixed (`every_steps`, `every_seconds`) or derived (`young`, `young-daly`) from measured
    inputs (ckpt.interval.IntervalInputs) that the controller feeds: `on_nodes` after
    placement, `on_save_cost` after each commit, `on_failure` and `on_restart` around each
    recovery. Until a save cost has been measured, checkpoint after `probe_steps` steps so a
    first cost is known early.
    """

    def __init__(self, cfg: CheckpointConfig, probe_steps: int = 10):
        self.cfg = cfg
        self.probe_steps = probe_steps
        self.inputs = IntervalInputs(MtbfEstimate(cfg.mtbf_s))

    def on_nodes(self, nodes: int) -> None:
        """The job runs on `nodes` nodes: with a per-node MTBF the system prior is node MTBF / nodes."""
        if self.cfg.node_mtbf_hours is not None and nodes > 0:
            self.inputs.mtbf.prior_s = self.cfg.node_mtbf_hours * 3600.0 / nodes

    def on_save_cost(self, blocking_s: float) -> None:
        self.inputs.on_save_cost(blocking_s)

    def on_failure(self) -> None:
        self.inputs.on_failure()

    def on_restart(self, restart_s: float) -> None:
        self.inputs.on_restart(restart_s)

    def interval_s(self) -> float | None:
        """The target interval in seconds; None for a step cadence or before a cost is measured."""
        rule = self.cfg.rule
        if rule == "steps":
            return None
        if rule == "seconds":
            return self.cfg.fixed_seconds
        return self.inputs.interval_s(rule)

    def every(self, step_times_s: list[float]) -> int:
        if self.cfg.every_steps is not None:
            return self.cfg.every_steps
        interval = self.interval_s()
        if interval is None or not step_times_s:
            return self.probe_steps
        return steps_for_interval(interval, statistics.median(step_times_s))


def hang_limit(median_step_s: float | None, completed: int, spec, min_s: float, factor: float) -> float:
    """Seconds without a step event after which the ranks count as hung.

    `factor` median steps, at least `min_s`. When a validation is due after the `completed`-th
    step (`eval.every_steps`, and after the last), the next step event comes later by the
    evaluation: forward passes over `eval.windows` windows, at most a training step's cost per
    global batch of them, so the limit grows by `factor` such steps (and `min_s` of start-up).
    """
    step = median_step_s or 0.0
    limit = max(min_s, factor * step)
    evaluation = getattr(spec, "eval", None)
    if evaluation is not None and completed > 0 and (completed % evaluation.every_steps == 0
                                                     or completed == spec.train.steps):
        limit += min_s + factor * step * max(1.0, evaluation.windows / spec.train.global_batch)
    return limit

