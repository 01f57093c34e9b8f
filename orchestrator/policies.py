"""Policies decide; only the controller acts (design.md section 2).

Each policy is a small object with pure decision methods, injected into the controller so
unit tests can drive one transition at a time and swap a policy for a fake.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from orchestrator.ckpt_plan import steps_for_interval, young_interval_s


@dataclass(frozen=True)
class FailureDecision:
    action: str  # "restart" | "fail"
    reason: str


class FailurePolicy:
    """Restart after a failure until `max_restarts` is spent, then fail the job."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts

    def decide(self, restarts_so_far: int, failure_kind: str) -> FailureDecision:
        if restarts_so_far >= self.max_restarts:
            return FailureDecision("fail", f"{restarts_so_far} restarts used, elastic.max_restarts={self.max_restarts}")
        return FailureDecision("restart", f"restart {restarts_so_far + 1} of {self.max_restarts}")


@dataclass(frozen=True)
class ScalingDecision:
    dp: int
    replace: list[int]  # ranks whose actors must be recreated
    reason: str


class ScalingPolicy:
    """Replace dead ranks in place (same layout). Shrinking and growing come with elasticity."""

    def __init__(self, min_dp: int):
        self.min_dp = min_dp

    def decide(self, dp: int, dead_ranks: list[int]) -> ScalingDecision:
        return ScalingDecision(dp=dp, replace=sorted(dead_ranks),
                               reason=f"replacing rank(s) {sorted(dead_ranks)}, dp stays {dp}")


class CheckpointIntervalPolicy:
    """How many steps between checkpoints: fixed (`every_steps`) or Young's tau* = sqrt(2 C M).

    C is the measured unhidden save cost (the ranks' blocking time, worst rank), M the
    configured system MTBF. Until a save has been measured, checkpoint after `probe_steps`
    steps so that a first cost is known early.
    """

    def __init__(self, every_steps: int | None, interval, mtbf_s: float, probe_steps: int = 10):
        self.every_steps = every_steps
        self.fixed_s = None if interval == "young" else float(interval)
        self.mtbf_s = mtbf_s
        self.probe_steps = probe_steps

    def interval_s(self, save_cost_s: float | None) -> float | None:
        if self.every_steps is not None:
            return None
        if self.fixed_s is not None:
            return self.fixed_s
        if save_cost_s is None:
            return None
        return young_interval_s(save_cost_s, self.mtbf_s)

    def every(self, save_costs_s: list[float], step_times_s: list[float]) -> int:
        if self.every_steps is not None:
            return self.every_steps
        cost = statistics.median(save_costs_s) if save_costs_s else None
        interval = self.interval_s(cost)
        if interval is None or not step_times_s:
            return self.probe_steps
        return steps_for_interval(interval, statistics.median(step_times_s))
