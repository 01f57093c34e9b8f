"""A checkpoint-interval sweep: one job, one seeded failure process, several checkpoint intervals.

Protocol (`undying chaos sweep`, orchestrator.cli.chaos.command drives it; nothing here runs a job):
  1. `parse_intervals("5s,10s,20s,young")`: fixed intervals in seconds and the adaptive rules.
  2. `step_seconds(report)` of a short failure-free run gives the step time that turns a fixed
     interval into `checkpoint.every_steps` (`sweep_spec`). Why not `every_seconds`: the
     controller converts seconds to steps only once it has step times, at the first restore,
     so until the first failure every interval would checkpoint at the 10-step probe cadence
     and the sweep would not measure the interval it names. The adaptive rules run as a user
     would run them, with `checkpoint.mtbf_s` set to the experiment's system MTBF (the
     prior a user who knows the failure rate gives; C and R are measured live).
  3. Every run gets its own name (`<name>.sweep-<label>`), so its own checkpoint root, and the
     same `chaos:` section: the failure times (job seconds) are the same in every run.
  4. `measure(label, target_s, report)` reads a run's report: goodput, steady goodput
     (productive / (wall - startup): the model has no start-up term), realised interval
     (median gap between commits with no failure between them), failures, C and R.
  5. orchestrator.cli.chaos.goodput_model fits C and R over the storage-only runs (the model is of one
     level); `summary` names the best fixed interval, tau*, how far the adaptive rules are from the
     best, and, with `--levels storage,two-level`, how many points the memory level adds at each interval.

Levels (`parse_levels`): each interval runs once per level asked for, under the same failures;
"storage" is the durable level alone (`checkpoint.memory.enabled: false`), "two-level" adds the memory
level at its own Young interval (docs/design.md, "Two levels"); the storage level keeps the interval
of the row in both. Without `--levels`, each interval runs at the spec's own level.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from chaos.config import RANK_KINDS
from chaos.durations import parse_duration
from orchestrator.cli.chaos.experiment import with_changes
from orchestrator.cli.chaos.goodput_model import ModelInputs
from orchestrator.spec.problems import Problem, SpecError

RULES = ("young", "young-daly")
LEVELS = ("storage", "two-level")


@dataclass(frozen=True)
class Interval:
    label: str  # "5s", "young"
    seconds: float | None  # None for an adaptive rule


def parse_intervals(text: str) -> list[Interval]:
    """`5s,10s,20s,young` -> intervals; SpecError naming `--intervals` for anything else."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    out, bad = [], []
    for item in items:
        if item in RULES:
            out.append(Interval(item, None))
            continue
        try:
            seconds = parse_duration(item)
        except ValueError:
            seconds = None
        if not isinstance(seconds, float) or seconds <= 0:
            bad.append(item)
        else:
            out.append(Interval(item, seconds))
    if bad or not out:
        what = f"cannot read {', '.join(map(repr, bad))}" if bad else "no interval given"
        raise SpecError([Problem("--intervals", f"{what}; give a comma-separated list of durations and rules, "
                                                f"e.g. 5s,10s,20s,40s,young")])
    return out


def parse_levels(text: str | None, spec) -> list[str]:
    """`storage,two-level` -> the levels each interval runs at; None -> the spec's own level."""
    if text is None:
        return ["two-level" if spec.checkpoint.memory.enabled else "storage"]
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in LEVELS]
    if bad or not items or len(set(items)) != len(items):
        what = f"cannot read {', '.join(map(repr, bad))}" if bad else "give each level once"
        raise SpecError([Problem("--levels", f"{what}; give storage, two-level or storage,two-level")])
    return items


def system_mtbf_s(spec) -> float:
    """The job's MTBF under its random failures: chaos.mtbf_s per rank, over the ranks (docs/design.md section 1)."""
    chaos = spec.chaos
    if chaos.mtbf_s is None or chaos.mtbf_kind not in RANK_KINDS:
        raise SpecError([Problem("chaos.mtbf_kind", "a sweep needs random rank failures (the model needs the "
                                 "number of targets before placement); give --mtbf and --kind kill_rank or hang_rank")])
    # The rate while failures come: --start delays the first (past start-up, which steady goodput leaves
    # out), and a --max-faults the runs reach would end them early, which the table's failure counts show.
    return chaos.mtbf_s / spec.world_size


def sweep_spec(base, interval: Interval, step_s: float, level: str | None = None):
    """The run of `base` at `interval`, at `level` (None: the spec's own; see module doc)."""
    suffix = "" if level in (None, "storage") else f".{level}"
    changes: dict = {"name": f"{base.name}.sweep-{interval.label}{suffix}", "checkpoint.every_seconds": None,
                     "checkpoint.mtbf_s": system_mtbf_s(base), "checkpoint.node_mtbf_hours": None}
    if level is not None:
        changes["checkpoint.memory.enabled"] = level == "two-level"
    if interval.seconds is None:
        changes.update({"checkpoint.every_steps": None, "checkpoint.interval": interval.label})
    else:
        changes["checkpoint.every_steps"] = max(1, round(interval.seconds / step_s))
    # Random failures for a whole experiment: the restart budget must not end it early.
    changes["elastic.max_restarts"] = max(base.elastic.max_restarts, 1000)
    return with_changes(base, changes)


def calibration_spec(base, steps: int = 30):
    """A short failure-free run of `base` that measures the step time (saves only at the end)."""
    steps = min(steps, base.train.steps)  # a warmup longer than that is cut to it: the step time is the same
    return with_changes(base, {"name": f"{base.name}.sweep-calibrate", "chaos": {}, "train.steps": steps,
                               "train.warmup_steps": min(base.train.warmup_steps, steps),
                               "checkpoint.every_steps": 10**6, "checkpoint.every_seconds": None})


def step_seconds(report) -> float:
    """Median seconds between consecutive completed steps (job seconds from the report)."""
    times = [p.time for p in sorted(report.losses, key=lambda p: p.step) if p.time is not None]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > a]
    if not gaps:
        raise ValueError("the calibration run completed too few steps to measure a step time")
    return statistics.median(gaps)


@dataclass(frozen=True)
class Row:
    label: str
    target_s: float | None  # the interval asked for (None: adaptive)
    every_steps: int | None
    realised_s: float | None  # median gap between commits with no failure in between
    goodput: float
    steady_goodput: float  # productive / (wall - startup)
    wall_s: float
    failures: int
    checkpoints: int
    cost_s: float | None  # median blocking seconds per save
    restart_s: float | None  # median fault -> training again
    status: str
    level: str = "storage"  # "storage" or "two-level"
    memory_recoveries: int = 0  # failures restored from the memory level


def realised_interval(report) -> float | None:
    commits = sorted(c.committed_at for c in report.checkpoints)
    failures = sorted(f.time for f in report.failures)
    gaps = [b - a for a, b in zip(commits, commits[1:], strict=False)
            if not any(a < t < b for t in failures)]
    return statistics.median(gaps) if gaps else None


def measure(label: str, target_s: float | None, every_steps: int | None, report, level: str = "storage") -> Row:
    g = report.goodput
    startup = g.badput_s.get("startup", 0.0)
    restarts = [f.detected_after_s + f.recovered_after_s for f in report.failures
                if f.detected_after_s is not None and f.recovered_after_s is not None]
    costs = [c.blocking_s for c in report.checkpoints]
    return Row(label=label, target_s=target_s, every_steps=every_steps, realised_s=realised_interval(report),
               goodput=g.ratio, steady_goodput=g.productive_s / (g.wall_s - startup) if g.wall_s > startup else 0.0,
               wall_s=g.wall_s, failures=len(report.failures), checkpoints=len(report.checkpoints),
               cost_s=statistics.median(costs) if costs else None,
               restart_s=statistics.median(restarts) if restarts else None, status=report.status, level=level,
               memory_recoveries=sum(f.restore_level == "memory" for f in report.failures))


def summary(rows: Sequence[Row], inputs: ModelInputs) -> dict:
    """The best fixed interval (by steady goodput), tau*, and each adaptive rule's distance from the best,
    among the storage-only runs (the level tau* models), else among the two-level ones."""
    level = "storage" if any(r.level == "storage" for r in rows) else "two-level"
    fixed = [r for r in rows if r.target_s is not None and r.status == "succeeded" and r.level == level]
    best = max(fixed, key=lambda r: r.steady_goodput) if fixed else None
    out = {"tau_star_s": inputs.tau_star, "model": asdict(inputs),
           "best_fixed": None if best is None else {"label": best.label, "steady_goodput": best.steady_goodput,
                                                    "realised_s": best.realised_s}}
    for row in rows:  # (a failed run's goodput is of the part it ran: no verdict)
        if row.target_s is None and best is not None and row.level == level and row.status == "succeeded":
            out[row.label] = {"points_below_best": 100 * (best.steady_goodput - row.steady_goodput),
                              "realised_s": row.realised_s}
    out["two_level_vs_storage"] = level_gains(rows)
    return out


def against_best(points_below: float) -> str:
    """`summary`'s points_below_best in words: "4.7 points below" it, or "5.5 points above" (it beat them)."""
    return f"{abs(points_below):.1f} points {'below' if points_below >= 0 else 'above'}"


def level_gains(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """Per interval run at both levels, two-level against storage-only: `goodput_points` (the difference,
    in points) and `wall_change` (how much longer two-level's wall is for the same steps, a fraction).
    The wall is the like-for-like figure: goodput counts a step the memory level's background work
    slowed as productive, so its points overstate the level's gain where that work shares the cores."""
    by = {(r.label, r.level): r for r in rows if r.status == "succeeded"}
    pairs = {label: (by[label, "storage"], by[label, "two-level"])
             for label, level in by if level == "storage" and (label, "two-level") in by}
    return {label: {"goodput_points": 100 * (two.goodput - one.goodput),
                    "wall_change": two.wall_s / one.wall_s - 1 if one.wall_s > 0 else 0.0}
            for label, (one, two) in pairs.items()}


def table(rows: Sequence[Row], inputs: ModelInputs) -> str:
    """A markdown table of the runs with the model's prediction at each realised interval."""
    lines = ["| interval | levels | every | realised tau | goodput | steady goodput | model | failures | saves"
             " | C | R | wall |", "|---" * 12 + "|"]
    for r in rows:
        tau = r.realised_s or r.target_s
        model = f"{100 * inputs.goodput(tau):.1f}%" if tau and r.level == "storage" else "-"
        level = r.level if r.level == "storage" else f"{r.level} ({r.memory_recoveries} from memory)"
        lines.append(f"| {r.label} | {level} | {r.every_steps or 'adaptive'} steps | {_s(r.realised_s)}"
                     f" | {100 * r.goodput:.1f}%"
                     f" | {100 * r.steady_goodput:.1f}% | {model} | {r.failures} | {r.checkpoints} | {_s(r.cost_s, 3)}"
                     f" | {_s(r.restart_s)} | {r.wall_s:.0f} s |" + ("" if r.status == "succeeded" else " FAILED"))
    return "\n".join(lines)


def _s(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def rows_to_json(rows: Sequence[Row]) -> list[Mapping]:
    return [asdict(r) for r in rows]
