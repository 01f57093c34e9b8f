"""How often to checkpoint: Young and Young-Daly intervals fed by measured costs and a live MTBF.

With C the cost of one save that training does not hide (the ranks' blocking time), M the
system's mean time between failures and R the time a restart costs (detection, re-formation,
restore):

    young       tau = sqrt(2 C M)                          (Young 1974, doi:10.1145/361147.361115)
    young-daly  tau = C + sqrt(2 (M + R) C + C^2)          (Daly 2006, doi:10.1016/j.future.2004.11.016)

Both minimise expected wasted time (save cost plus lost work plus restarts) to first order.
Protocol: the controller owns one `IntervalInputs`; it calls `on_save_cost` after every
commit, `on_failure` when a failure is detected, `on_restart` when training runs again, and
`interval_s` whenever it publishes a new checkpoint plan. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def young_daly_interval_s(cost_s: float, mtbf_s: float, restart_s: float) -> float:
    cost_s = max(cost_s, 0.0)
    return cost_s + math.sqrt(2.0 * (mtbf_s + max(restart_s, 0.0)) * cost_s + cost_s * cost_s)


@dataclass
class MtbfEstimate:
    """System MTBF: a prior, updated with the failures this job observes.

    A Gamma prior on the failure rate worth one pseudo-failure in `prior_s` seconds; after
    n failures in T seconds of exposure the posterior mean MTBF is (prior_s + T) / (1 + n).
    So a job that fails more often than the prior assumed checkpoints more often within a
    few failures, and one that runs clean drifts slowly towards longer intervals.
    """

    prior_s: float
    started_at: float = field(default_factory=time.monotonic)
    failures: int = 0

    def __post_init__(self) -> None:
        if self.prior_s <= 0:
            raise ValueError(f"MTBF prior must be positive seconds, got {self.prior_s}")

    def on_failure(self) -> None:
        self.failures += 1

    def mtbf_s(self, now: float | None = None) -> float:
        exposure = max(0.0, (time.monotonic() if now is None else now) - self.started_at)
        return (self.prior_s + exposure) / (1 + self.failures)


@dataclass
class MovingAverage:
    """Exponential moving average; None until the first sample."""

    alpha: float = 0.3
    value: float | None = None

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else self.alpha * sample + (1 - self.alpha) * self.value
        return self.value


@dataclass
class IntervalInputs:
    """The measured inputs of the interval formulas, kept by the controller."""

    mtbf: MtbfEstimate
    cost: MovingAverage = field(default_factory=MovingAverage)
    restart: MovingAverage = field(default_factory=MovingAverage)

    def on_save_cost(self, blocking_s: float) -> None:
        self.cost.add(blocking_s)

    def on_failure(self) -> None:
        self.mtbf.on_failure()

    def on_restart(self, restart_s: float) -> None:
        self.restart.add(restart_s)

    def interval_s(self, rule: str, now: float | None = None) -> float | None:
        """tau for `rule` ("young" or "young-daly"); None until a save cost has been measured.

        Before the first restart R is unknown; Young-Daly then takes R = 0, which is Young's
        formula plus C and a second-order term.
        """
        if self.cost.value is None:
            return None
        mtbf = self.mtbf.mtbf_s(now)
        if rule == "young":
            return young_interval_s(self.cost.value, mtbf)
        if rule == "young-daly":
            return young_daly_interval_s(self.cost.value, mtbf, self.restart.value or 0.0)
        raise ValueError(f"unknown interval rule {rule!r}: expected 'young' or 'young-daly'")

    def snapshot(self, now: float | None = None) -> dict[str, float | None]:
        """The inputs as numbers, for metrics and the run report."""
        return {"cost_s": self.cost.value, "mtbf_s": self.mtbf.mtbf_s(now), "restart_s": self.restart.value,
                "failures": float(self.mtbf.failures)}


def steps_for_interval(interval_s: float, step_s: float, lo: int = 1, hi: int = 1_000_000) -> int:
    """Whole steps closest to an interval in seconds, at least `lo`."""
    if step_s <= 0:
        return lo
    return max(lo, min(hi, round(interval_s / step_s)))
