"""The run report written at the end of each run: JSON, a terminal table and progress lines.

Protocol. The controller accumulates the records below while the job runs (single-threaded),
builds one `RunReport` when it reaches SUCCEEDED or FAILED (after `GoodputLedger.stop()`), and
writes it with `to_json`; `summary_table()` is printed to the terminal and
`monitor.timeline.plot_timeline` draws the PNG. `progress_line` is printed once per progress
interval while the job runs.

Times (`started_at`, `committed_at`, failure `time`) are job seconds: the ledger's `wall()` at
the moment of the event. Unlike the host's clock they keep counting across controller restarts
(the ledger is carried in checkpoints), so one report's events stay on one time axis.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from monitor.goodput import BADPUT_CAUSES, BUCKETS, PRODUCTIVE, GoodputLedger

# NaN losses are real (a NaN-gradient fault, a diverged run); "strings" keeps the JSON valid
# for strict parsers (jq) and still round-trips through pydantic, where "null" would not.
_CONFIG = ConfigDict(extra="forbid", ser_json_inf_nan="strings")


# The report's loss curve holds every step of a run up to this many steps; a longer run's holds
# every k-th (k the smallest stride that fits) and its last, so that the report of a 10^6-step
# job stays a few MB. The event log, TensorBoard and W&B get every step.
LOSS_POINTS = 20_000


def loss_curve_steps(steps: list[int]) -> list[int]:
    """Which of the recorded `steps` (in step order) the report's loss curve holds."""
    if len(steps) <= LOSS_POINTS:
        return steps
    kept = steps[::-(-len(steps) // LOSS_POINTS)]
    return kept if kept[-1] == steps[-1] else [*kept, steps[-1]]


class LossPoint(BaseModel):
    model_config = _CONFIG
    step: int
    loss: float
    time: float | None = None  # job seconds when the step finished
    tokens_per_s: float | None = None  # global throughput of that step


class EvalPoint(BaseModel):
    """A validation loss (trainer.evaluation) of the model after `step` steps."""

    model_config = _CONFIG
    step: int
    loss: float
    tokens: int
    seconds: float  # how long the evaluation took
    time: float | None = None  # job seconds when it finished


class WorldRecord(BaseModel):
    """One membership generation and the layout it trained with."""

    model_config = _CONFIG
    generation: int
    world_size: int
    dp: int
    tp: int
    pp: int
    started_at: float  # job seconds


class FailureRecord(BaseModel):
    model_config = _CONFIG
    time: float  # job seconds when the failure was detected
    kind: str
    rank: int | None = None  # None when no single rank is to blame (e.g. a storage error)
    detected_after_s: float | None = None  # failure -> detection, when the failure time is known
    recovered_after_s: float | None = None  # detection -> training again; None if never recovered
    # failure (the fault itself when known, else its detection) -> first step completed afterwards
    first_step_after_s: float | None = None
    message: str = ""
    # The running generation's newest step the controller had seen (after a rollback, not the furthest
    # ever reached), so the failure can be marked on the loss curve.
    step: int | None = None
    # The level the recovery restored from ("memory" or "storage"; None: it never restored, or a
    # fresh start), the bytes that restore read from durable storage (all ranks), its seconds and
    # the seconds of work it rolled back: the goodput ledger's restore and lost work, per level.
    restore_level: Literal["memory", "storage"] | None = None
    storage_read_bytes: int | None = None
    restore_s: float | None = None
    lost_work_s: float | None = None
    # Survivors killed because they were not out of the broken generation within the release
    # timeout (hung in a collective); each costs a replacement of its own.
    killed_at_release: list[int] = []


class FaultRecord(BaseModel):
    """An injected fault (chaos) that fired, as its notice reached the controller; whether it
    became a failure is in `failures` (two kills in one step are one failure, a storage fault none)."""

    model_config = _CONFIG
    time: float | None = None  # job seconds when it fired (on the controller's clock); None: not sent
    kind: str
    fault_id: int | None = None  # its id: a scripted fault's index in chaos.faults, random ones after them
    rank: int | None = None
    step: int | None = None
    point: str | None = None  # the named point it fired at, e.g. after_backward
    detail: str | None = None  # what it did (corrupt_shard: the bit flipped, or why it could not be applied)


class CheckpointRecord(BaseModel):
    """One committed checkpoint (a save exists only once its manifest is committed)."""

    model_config = _CONFIG
    step: int
    committed_at: float  # job seconds
    bytes: int
    blocking_s: float
    total_s: float


class RolledBackStep(BaseModel):
    """An execution of a step that a rollback threw away: the step was computed again later.

    `step_s` is rank 0's wall time of that execution; the sum over a rollback's steps, plus
    the interrupted step up to the fault, is what the ledger books as `lost_work`
    (monitor.goodput explains the definition)."""

    model_config = _CONFIG
    step: int
    step_s: float
    finished_at: float  # job seconds when that execution finished


class StragglerRecord(BaseModel):
    """A rank flagged as a sustained straggler."""

    model_config = _CONFIG
    time: float  # job seconds when it was flagged
    rank: int
    ratio: float  # its median compute time over its peers' median


class GoodputSummary(BaseModel):
    model_config = _CONFIG
    ratio: float
    wall_s: float  # the sum of the buckets
    productive_s: float
    badput_s: dict[str, float]
    # The ledger's own clock (carried wall + its start-to-stop reading), kept apart from the
    # buckets: what "buckets sum to wall" is checked against (None in reports of older releases).
    clock_wall_s: float | None = None

    @classmethod
    def from_totals(cls, totals: Mapping[str, float]) -> GoodputSummary:
        """Summarise `GoodputLedger.totals()`; wall is their sum (equal by the ledger's invariant)."""
        wall = sum(totals.get(bucket, 0.0) for bucket in BUCKETS)
        productive = totals.get(PRODUCTIVE, 0.0)
        return cls(
            ratio=productive / wall if wall > 0 else 0.0,
            wall_s=wall,
            productive_s=productive,
            badput_s={cause: totals.get(cause, 0.0) for cause in BADPUT_CAUSES},
        )

    @classmethod
    def from_ledger(cls, ledger: GoodputLedger) -> GoodputSummary:
        return cls.from_totals(ledger.totals()).model_copy(update={"clock_wall_s": ledger.wall()})


class RunReport(BaseModel):
    """Everything a user needs to judge a run once it is over."""

    model_config = _CONFIG
    job: str
    final_step: int
    final_loss: float | None = None
    losses: list[LossPoint] = Field(default_factory=list)  # thinned past LOSS_POINTS steps
    evals: list[EvalPoint] = Field(default_factory=list)
    world_history: list[WorldRecord] = Field(default_factory=list)
    failures: list[FailureRecord] = Field(default_factory=list)
    faults: list[FaultRecord] = Field(default_factory=list)  # injected faults that fired, in order
    # Time-triggered faults that came due with no rank to fire at (a node without ranks, a shrunk job).
    faults_skipped: list[FaultRecord] = Field(default_factory=list)
    checkpoints: list[CheckpointRecord] = Field(default_factory=list)
    stragglers: list[StragglerRecord] = Field(default_factory=list)
    # Runs of completed steps ["steps", first, end, dp] and ["restore", step] per restore, in
    # order (orchestrator.controller.step_history).
    history: list[list] = Field(default_factory=list)
    # Steps computed again after a rollback, and the seconds of those second executions (what
    # redoing the lost work cost); the executions they replaced are in `rolled_back`.
    redone_steps: int = 0
    redone_s: float = 0.0
    rolled_back: list[RolledBackStep] = Field(default_factory=list)
    goodput: GoodputSummary
    # preempted: stopped by a signal, exit 75; unfinished: rebuilt from an event log that ends before
    # the run did (monitor.events)
    status: Literal["succeeded", "failed", "preempted", "unfinished"]
    error: str | None = None
    tokens_per_s: float | None = None  # mean global throughput over productive time

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the report to a local `path`, creating its parent directory.

        Written to a temporary file and renamed, so a reader never sees half a report.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(self.model_dump_json(indent=2))
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> RunReport:
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))

    def summary_table(self) -> str:
        """A compact terminal table: run facts, then seconds and share per goodput bucket."""
        recoveries = sum(1 for failure in self.failures if failure.recovered_after_s is not None)
        facts = [
            ("status", self.status + (f" ({self.error})" if self.error else "")),
            ("steps", str(self.final_step)),
            ("final loss", _fmt_loss(self.final_loss)),
            ("tokens/s", _si(self.tokens_per_s)),
            ("failures", str(len(self.failures))),
            ("recoveries", str(recoveries) + _by_level(self.failures)),
            ("checkpoints", str(len(self.checkpoints))),
            ("goodput", f"{100 * self.goodput.ratio:.1f}%"),
        ]
        lines = [f"run {self.job}"]
        lines += [f"  {name:<12} {value}" for name, value in facts]
        lines += ["", f"  {'bucket':<22} {'seconds':>10} {'share':>7}"]
        wall = self.goodput.wall_s
        seconds = {PRODUCTIVE: self.goodput.productive_s, **self.goodput.badput_s}
        for bucket in BUCKETS:
            value = seconds.get(bucket, 0.0)
            lines.append(f"  {bucket:<22} {value:>10.1f} {_share(value, wall):>7}")
        lines.append(f"  {'wall':<22} {wall:>10.1f} {_share(wall, wall):>7}")
        return "\n".join(lines)


def _by_level(failures: list[FailureRecord]) -> str:
    """" (memory 3: restore 0.4 s, lost 0.2 s; storage 1: ...)" over the recoveries that restored."""
    parts = []
    for level in ("memory", "storage"):
        mine = [f for f in failures if f.restore_level == level]
        if mine:
            parts.append(f"{level} {len(mine)}: restore {sum(f.restore_s or 0.0 for f in mine):.1f} s, "
                         f"lost {sum(f.lost_work_s or 0.0 for f in mine):.1f} s")
    return f" ({'; '.join(parts)})" if parts else ""


def progress_line(
    step: int, total: int, loss: float | None, tokens_per_s: float | None, goodput: float
) -> str:
    """One compact progress line, e.g. `[  25/60] loss 4.123  tok/s 12.3k  goodput 87.1%`.

    `goodput` is the ratio (0..1). The step is padded to a fixed width so lines align.
    """
    width = max(4, len(str(total)))
    return (
        f"[{step:>{width}}/{total}] loss {_fmt_loss(loss)}  tok/s {_si(tokens_per_s)}"
        f"  goodput {100 * goodput:.1f}%"
    )


def _fmt_loss(loss: float | None) -> str:
    if loss is None:
        return "-"
    return "nan" if math.isnan(loss) else f"{loss:.3f}"


def _share(value: float, wall: float) -> str:
    return f"{100 * value / wall:.1f}%" if wall > 0 else "-"


def _si(value: float | None) -> str:
    """Human-sized numbers for throughput: 950, 12.3k, 4.5M, 1.2G."""
    if value is None or math.isnan(value):
        return "-"
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        # Compare after rounding so 999,960 prints as 1.0M, not 1000.0k.
        if round(abs(value) / factor, 1) >= 1.0:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"
