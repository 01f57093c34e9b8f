"""The run's events: what the controller tells its trackers, and the report rebuilt from them.

Protocol. The controller's `JobRecord` (single-threaded) builds one event per thing it learns
with the constructors below and hands it to its trackers (`monitor.tracking.Trackers.emit`):
the TensorBoard and Weights & Biases writers turn events into scalars, the event log
(`monitor.event_log`) keeps them as JSON lines under the checkpoint root. `report_from_events`
reads such a log back into the `RunReport` that `JobRecord.report` built at the end of the run.

An event is a dict: `kind`, `at_step` (the global step to plot it at: the step itself for a
step, a validation or a commit, the steps completed so far for the rest) and `t` (epoch
seconds), then the payload. Kinds and payloads (`record`: one of the report's records, whole):

    start       job, total_steps
    step        step, loss, tokens, step_s, time (job seconds), tokens_per_s, mfu, grad_norm
    eval        record: monitor.report.EvalPoint
    layout      record: monitor.report.WorldRecord
    failure     index (the n-th failure of this run, from 0), record: FailureRecord; sent again,
                whole, each time the record learns more (restore, recovery, first step after it)
    fault       record: FaultRecord, as the injected fault fires (the end event lists them too)
    checkpoint  record: monitor.report.CheckpointRecord
    goodput     totals (seconds per bucket), ratio, wall (the ledger's clock)
    end         job, status, error, final_step, goodput (GoodputSummary), and the lists the report holds
                whole: failures, stragglers, history, rolled_back, redone_steps, redone_s

A log without `end` (the controller's pod died, or the run goes on) rebuilds as status
`unfinished` from the newest goodput event.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from pydantic import BaseModel

from monitor.goodput import BUCKETS, GoodputLedger
from monitor.report import (
    CheckpointRecord,
    EvalPoint,
    FailureRecord,
    FaultRecord,
    GoodputSummary,
    LossPoint,
    RolledBackStep,
    RunReport,
    StragglerRecord,
    WorldRecord,
    loss_curve_steps,
)

KINDS = ("start", "step", "eval", "layout", "failure", "fault", "checkpoint", "goodput", "end")


def event(kind: str, at_step: int, **payload) -> dict:
    assert kind in KINDS, kind
    return {"kind": kind, "at_step": int(at_step), "t": time.time(), **payload}


def record_event(kind: str, at_step: int, record: BaseModel, **extra) -> dict:
    """An event carrying one of the report's records (an EvalPoint, a FailureRecord...)."""
    return event(kind, at_step, record=record.model_dump(), **extra)


def step_event(step: int, loss: float, tokens: int, step_s: float, time_s: float, mfu: float | None,
               grad_norm: float | None) -> dict:
    return event("step", step, step=step, loss=loss, tokens=tokens, step_s=step_s, time=time_s,
                 tokens_per_s=tokens / step_s if step_s > 0 else None, mfu=mfu, grad_norm=grad_norm)


def goodput_event(at_step: int, ledger: GoodputLedger) -> dict:
    return event("goodput", at_step, totals=ledger.totals(), ratio=ledger.goodput(), wall=ledger.wall())


def end_event(report: RunReport) -> dict:
    dumped = report.model_dump(include={"goodput", "failures", "faults", "stragglers", "history", "rolled_back",
                                        "redone_steps", "redone_s"})
    return event("end", report.final_step, job=report.job, status=report.status, error=report.error,
                 final_step=report.final_step, **dumped)


def to_json_safe(value):
    """`value` with every NaN or infinity as the string pydantic writes for it ("NaN", "Infinity"),
    so each line is strict JSON (jq reads it) and still parses back into the report's floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_safe(v) for v in value]
    return value


def _as(model: type[BaseModel], ev: dict) -> BaseModel:
    return model.model_validate(ev["record"])


def report_from_events(events: Iterable[dict], job: str | None = None) -> RunReport:
    """The `RunReport` of one run of the controller, from its events in the order they were sent.

    Rebuilt the way `JobRecord.report` builds it: one loss per step (a step recomputed after a
    rollback replaces the earlier record), validations one per step sorted, layouts and commits
    in order; the `end` event supplies what only the end of the run knows. Raises ValueError
    when there is no event to rebuild from."""
    steps: dict[int, dict] = {}
    evals: dict[int, EvalPoint] = {}
    world, checkpoints, failures, faults = [], [], {}, []
    start, goodput, end = None, None, None
    for ev in events:
        kind = ev.get("kind")
        if kind == "start":
            start = ev
        elif kind == "step":
            steps[int(ev["step"])] = ev
        elif kind == "eval":
            point = _as(EvalPoint, ev)
            evals.pop(point.step, None)  # a re-evaluation after a rollback: the newest, last
            evals[point.step] = point
        elif kind == "layout":
            world.append(_as(WorldRecord, ev))
        elif kind == "checkpoint":
            checkpoints.append(_as(CheckpointRecord, ev))
        elif kind == "failure":
            failures[int(ev["index"])] = _as(FailureRecord, ev)
        elif kind == "fault":  # also in the end event; these are what a run that never ended leaves
            faults.append(_as(FaultRecord, ev))
        elif kind == "goodput":
            goodput = ev
        elif kind == "end":
            end = ev
    if start is None and not steps and end is None:
        raise ValueError("no events to rebuild a report from")
    job = job or (end or start or {}).get("job", "?")
    return _report(job, steps, evals, world, checkpoints, failures, faults, goodput, end)


def _report(job, steps, evals, world, checkpoints, failures, faults, goodput, end) -> RunReport:
    losses = [LossPoint(step=s, loss=steps[s]["loss"], time=steps[s]["time"],
                        tokens_per_s=steps[s].get("tokens_per_s")) for s in loss_curve_steps(sorted(steps))]
    busy = sum(float(ev["step_s"]) for ev in steps.values())
    tokens = sum(int(ev["tokens"]) for ev in steps.values())
    common = {
        "job": job, "losses": losses, "evals": [evals[s] for s in sorted(evals)], "world_history": world,
        "checkpoints": checkpoints, "final_loss": losses[-1].loss if losses else None,
        "tokens_per_s": tokens / busy if busy > 0 else None,
    }
    if end is not None:
        return RunReport(
            **common, status=end["status"], error=end.get("error"), final_step=end["final_step"],
            goodput=GoodputSummary.model_validate(end["goodput"]),
            failures=[FailureRecord.model_validate(f) for f in end.get("failures", [])],
            faults=[FaultRecord.model_validate(f) for f in end.get("faults", [])],
            stragglers=[StragglerRecord.model_validate(s) for s in end.get("stragglers", [])],
            history=end.get("history", []), redone_steps=end.get("redone_steps", 0),
            redone_s=end.get("redone_s", 0.0),
            rolled_back=[RolledBackStep.model_validate(r) for r in end.get("rolled_back", [])],
        )
    summary = GoodputSummary.from_totals(goodput["totals"] if goodput else {})
    if goodput is not None:
        summary = summary.model_copy(update={"clock_wall_s": goodput.get("wall")})
    return RunReport(**common, status="unfinished", final_step=checkpoints[-1].step if checkpoints else 0,
                     goodput=summary, failures=[failures[i] for i in sorted(failures)], faults=faults,
                     error="the event log ends before the run did (its controller stopped, or it still runs)")


_SCALARS = {  # kind -> (tag prefix, {payload field: tag name}); the x axis is the event's own step
    "step": ("train", {n: n for n in ("loss", "tokens_per_s", "step_s", "mfu", "grad_norm")}),
    "eval": ("eval", {"loss": "loss"}),
    "checkpoint": ("checkpoint", {n: n for n in ("bytes", "blocking_s", "total_s")}),
    "layout": ("world", {"world_size": "size", "dp": "dp"}),
}
_RECOVERY = ("detected_after_s", "recovered_after_s", "restore_s", "lost_work_s", "first_step_after_s")


class Scalars:
    """Events as rows of scalars for the trackers that draw curves (TensorBoard, W&B).

    `row(event)` returns (x, {tag: value}): x the global step, tags `prefix/name`, None values
    left out. A failure, sent again as its record fills in, is counted once (`recovery/failures`)
    and its times are given once, when it has recovered and its first step after is known."""

    def __init__(self) -> None:
        self._failures: set[int] = set()
        self._timed: set[int] = set()

    def row(self, ev: dict) -> tuple[int, dict[str, float]]:
        kind, x = ev["kind"], int(ev["at_step"])
        if kind == "goodput":
            return x, {"goodput/ratio": float(ev["ratio"]),
                       **{f"goodput/{b}_s": float(ev["totals"].get(b, 0.0)) for b in BUCKETS}}
        if kind == "failure":
            return x, self._failure(ev)
        if kind not in _SCALARS:
            return x, {}
        prefix, names = _SCALARS[kind]
        values = ev.get("record", ev)
        return x, {f"{prefix}/{tag}": float(values[field]) for field, tag in names.items()
                   if values.get(field) is not None}

    def _failure(self, ev: dict) -> dict[str, float]:
        out, index, record = {}, int(ev["index"]), ev["record"]
        if index not in self._failures:
            self._failures.add(index)
            out["recovery/failures"] = float(len(self._failures))
        if record.get("first_step_after_s") is not None and index not in self._timed:
            self._timed.add(index)
            out.update({f"recovery/{n}": float(record[n]) for n in _RECOVERY if record.get(n) is not None})
        return out
