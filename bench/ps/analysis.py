"""The pure parts of bench.ps: traffic formulas, loss-versus-wall-time curves, the time a run
first reaches a target loss, and the tables. No processes; tests/unit/test_bench_ps.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

INDEX_BYTES = 8  # a sparse row travels with its int64 row id
# bsp equals collective dp to this on loss (summation order): a run this close to bsp's final loss
# has reached it.
PARITY = 1e-5


# Traffic per training step for D workers (ranks), K servers and S bytes of state.
def ps_total(workers: int, state_bytes: float) -> float:
    """Every worker pulls the state and pushes a gradient of the same size: 2DS."""
    return 2 * workers * state_bytes


def ps_per_server(workers: int, state_bytes: float, servers: int) -> float:
    """2DS/K: a server's share of it, with the state split evenly."""
    return ps_total(workers, state_bytes) / servers


def ring_per_rank(workers: int, state_bytes: float) -> float:
    """Ring all-reduce: a reduce-scatter and an all-gather, each (D-1)/D S sent per rank."""
    return 2 * (workers - 1) / workers * state_bytes


def sparse_state_bytes(dense_bytes: float, rows: float, row_bytes: int) -> float:
    """S of the sparse path, per worker and step: the dense parameters and the embedding rows the
    step's tokens touched, each with its row id."""
    return dense_bytes + rows * (row_bytes + INDEX_BYTES)


@dataclass(frozen=True)
class Event:
    """A loss that became known: one worker's step (ps) or one global step (collective)."""

    t: float  # seconds since every worker (rank) finished its first step
    loss_sum: float  # token-summed loss
    tokens: int


# Time 0 of a run is when every worker (rank) has finished its first step: actors and processes
# start one after another on a small machine, and a first step also waits for the servers' start-up
# (ps) or the first connection of the group (gloo), which is not what the runs compare.

def ps_events(logs: Iterable) -> list[Event]:
    """Events of a ps run's worker step logs (paramserver.actors.StepLog), in finishing order."""
    logs = list(logs)
    t0 = max(log.finished_at for log in logs if log.step == 0)
    return sorted((Event(log.finished_at - t0, log.loss_sum, log.tokens) for log in logs), key=lambda e: e.t)


def collective_events(ranks: list[list[dict]]) -> list[Event]:
    """Events of a collective run: per rank a list of steps {ended, loss, tokens} (time.time()), the
    global loss of a step known when its last rank ended it."""
    t0 = max(steps[0]["ended"] for steps in ranks)
    out = []
    for i, step in enumerate(ranks[0]):
        ended = max(steps[i]["ended"] for steps in ranks)
        out.append(Event(ended - t0, step["loss"] * step["tokens"], step["tokens"]))
    return out


def curve(events: list[Event], window: int) -> list[tuple[float, float]]:
    """(t, loss) after each event: the token-weighted loss of the last `window` events (all of them
    before the first `window`), which smooths the per-batch noise."""
    out = []
    for i, event in enumerate(events):
        part = events[max(0, i - window + 1):i + 1]
        out.append((event.t, sum(e.loss_sum for e in part) / sum(e.tokens for e in part)))
    return out


def time_to_loss(points: list[tuple[float, float]], target: float, tolerance: float = PARITY) -> float | None:
    """The first time the curve is at or below `target` (within `tolerance`); None when it never is."""
    return next((t for t, loss in points if loss <= target + tolerance), None)


@dataclass
class Run:
    """One training run, as the tables and the plot read it."""

    mode: str  # "collective dp", "ps bsp", "ps ssp s=3", "ps asp"
    straggler: bool
    steps: int
    events: list[Event]
    window: int  # events per smoothing window: steps x events per step
    staleness: list[int] = field(default_factory=list)  # per applied update (ps)

    @property
    def points(self) -> list[tuple[float, float]]:
        return curve(self.events, self.window)

    @property
    def wall_s(self) -> float:
        return self.events[-1].t

    @property
    def final_loss(self) -> float:
        return self.points[-1][1]


def rows(runs: list[Run], target: float) -> list[dict]:
    """One row per run: wall time against the collective run of the same straggler setting, the
    final loss, and when the run first reached `target` (bsp's final loss)."""
    anchor = {r.straggler: r.wall_s for r in runs if r.mode == "collective dp"}
    out = []
    for run in runs:
        reached = time_to_loss(run.points, target)
        out.append({"mode": run.mode, "straggler": run.straggler, "wall_s": run.wall_s,
                    "step_s": run.wall_s / max(1, run.steps - 1),
                    "vs_collective": run.wall_s / anchor[run.straggler] if run.straggler in anchor else None,
                    "final_loss": run.final_loss, "to_target_s": reached,
                    "staleness_mean": sum(run.staleness) / len(run.staleness) if run.staleness else None,
                    "staleness_max": max(run.staleness) if run.staleness else None})
    return out


def run_table(table_rows: list[dict], straggler_text: str, target: float) -> str:
    lines = ["| run | straggler | wall, steps 2..N | mean step | vs collective dp | loss at the end | "
             f"time to bsp's final loss ({target:.3f}) | staleness mean / max |", "|---|---|---|---|---|---|---|---|"]
    for r in table_rows:
        cells = [r["mode"], straggler_text if r["straggler"] else "none", f"{r['wall_s']:.1f} s",
                 f"{r['step_s'] * 1e3:.0f} ms",
                 "-" if r["vs_collective"] is None else f"{r['vs_collective']:.2f}x", f"{r['final_loss']:.3f}",
                 "not reached" if r["to_target_s"] is None else f"{r['to_target_s']:.1f} s",
                 "-" if r["staleness_mean"] is None else f"{r['staleness_mean']:.2f} / {r['staleness_max']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f} MB"


def bytes_table(byte_rows: list[dict]) -> str:
    """Rows {what, measured (bytes or None: not measured), formula text, formula bytes}."""
    lines = ["| traffic per step | measured | formula | measured / formula |", "|---|---|---|---|"]
    for r in byte_rows:
        measured = "computed only" if r["measured"] is None else mb(r["measured"])
        ratio = "-" if r["measured"] is None else f"{r['measured'] / r['formula']:.3f}"
        lines.append(f"| {r['what']} | {measured} | {r['formula_text']} = {mb(r['formula'])} | {ratio} |")
    return "\n".join(lines)
