"""First-order goodput model of periodic checkpointing under random failures (docs/design.md section 1).

With a checkpoint every `tau` seconds of training, an unhidden save cost `C` per checkpoint,
system failures as a Poisson process with mean time between failures `M`, and a restart
cost `R` per failure (detection, re-formation, restore), a failure loses on average half an
interval of work plus R, and every interval pays C once. To first order in C/tau and tau/M:

    goodput(tau) ~= 1 - C / tau - (tau / 2 + R) / M

which is maximal at Young's interval tau* = sqrt(2 C M) (the derivative C/tau^2 - 1/(2M)
vanishes there). The model ignores start-up and assumes tau >> step time; it is the oracle
`undying chaos sweep` plots its measurements against. Pure arithmetic, no I/O.

`inputs_from_reports` measures C and R from run reports (JSON dicts of monitor.report.RunReport):
C is the median blocking time of the committed saves, R the median time from a fault to
training again (`detected_after_s + recovered_after_s`) over the recovered failures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def model_goodput(tau_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Predicted share of productive time at interval `tau_s`, clamped to [0, 1]."""
    if not tau_s > 0 or not mtbf_s > 0:
        raise ValueError(f"tau and MTBF must be positive seconds, got tau={tau_s!r}, mtbf={mtbf_s!r}")
    value = 1.0 - max(cost_s, 0.0) / tau_s - (tau_s / 2.0 + max(restart_s, 0.0)) / mtbf_s
    return min(1.0, max(0.0, value))


def young_tau(cost_s: float, mtbf_s: float) -> float:
    """tau* = sqrt(2 C M): the interval that maximises `model_goodput`."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def curve(taus: Iterable[float], cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> list[float]:
    return [model_goodput(t, cost_s, mtbf_s, restart_s) for t in taus]


def log_grid(lo: float, hi: float, n: int = 200) -> list[float]:
    """`n` points from `lo` to `hi`, evenly spaced in log (intervals span decades)."""
    if not 0 < lo < hi or n < 2:
        raise ValueError(f"need 0 < lo < hi and n >= 2, got lo={lo}, hi={hi}, n={n}")
    step = math.log(hi / lo) / (n - 1)
    return [lo * math.exp(i * step) for i in range(n)]


@dataclass(frozen=True)
class ModelInputs:
    cost_s: float  # C: median blocking seconds of one committed save
    restart_s: float  # R: median fault -> training-again seconds
    mtbf_s: float  # M: the system's mean time between failures (the experiment's, not measured)
    saves: int  # how many saves C was measured from
    restarts: int  # how many recoveries R was measured from

    @property
    def tau_star(self) -> float:
        return young_tau(self.cost_s, self.mtbf_s)

    def goodput(self, tau_s: float) -> float:
        return model_goodput(tau_s, self.cost_s, self.mtbf_s, self.restart_s)


def inputs_from_reports(reports: Iterable[Mapping], mtbf_s: float) -> ModelInputs:
    """C and R measured over every run's report (see module doc); M is given.

    ValueError when no run committed a save (C unknown). R is 0 when no run recovered.
    """
    reports = list(reports)
    costs = [c["blocking_s"] for r in reports for c in r.get("checkpoints", [])]
    restarts = [f["detected_after_s"] + f["recovered_after_s"] for r in reports for f in r.get("failures", [])
                if f.get("detected_after_s") is not None and f.get("recovered_after_s") is not None]
    if not costs:
        raise ValueError("no committed checkpoint in any report: the save cost C cannot be measured")
    return ModelInputs(cost_s=statistics.median(costs), restart_s=statistics.median(restarts) if restarts else 0.0,
                       mtbf_s=mtbf_s, saves=len(costs), restarts=len(restarts))
