"""The training history a chaos run records, and the part of it that survives in the final model.

Protocol: while a job runs, the controller appends to one list, in the order things happen,
a `StepRecord(step, dp_size)` for each optimizer step a generation completed (rank 0's step
event; `dp_size` is the data-parallel degree it ran with; `samples` the per-dp-rank sample
ids if the ranks report them) and a `Restored(step)` each time a generation resumes from the
checkpoint whose next step is `step` (0 for a start from scratch after a failure before any
commit). At the end, `surviving_history(events)` drops the steps that a restore rolled back,
and orchestrator.cli.chaos.invariants.check_data_once checks what is left: every step of 0..final-1 exactly
once, each consuming every sample of its global batch exactly once.

A step computed twice without a restore in between stays twice in the surviving history on
purpose: nothing rolled it back, so its update was applied twice.

What the ranks consumed, as they report it: at each commit the controller appends
`["samples", first, end, count, digest]`, the sum over the dp replicas of the digests
(trainer.batch.SampleDigest) of the samples they consumed in steps first..end-1 (first: the
generation's restore point; end: the committed step). `surviving_samples(events)` keeps the
reports whose steps survive: a restore to step X drops reports that end after X, and of a
generation's (same `first`) remaining reports the one reaching furthest counts. The surviving reports
should tile 0..final-1, and their digests equal those of the samples the data schedule
assigns to those steps (the exactly-once check compares them).

Stored form (in the job record, the run report and every checkpoint's manifest): consecutive
steps with one layout are one run, `["steps", first, end, dp_size]` for steps first..end-1
(`record_step` appends that way), so a million-step job without failures is one entry, not a
million. A restore is `["restore", step]`; a step with recorded samples stays one
`[step, dp_size, samples]`. A repeated step never extends a run (its `first` would not be the
run's `end`), so runs lose nothing the exactly-once check needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One completed optimizer step and the layout it ran with."""

    step: int
    dp_size: int
    # Sample ids each dp rank consumed, in dp-rank order, when recorded; None: derive them
    # from the data cursor (trainer.data.DataCursor.sample_ids) for `dp_size`.
    samples: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class SampleReport:
    """The ranks' digest of the samples of steps first..end-1 (see the module docstring)."""

    first: int
    end: int
    count: int
    digest: int


@dataclass(frozen=True)
class Restored:
    """A generation resumed from the checkpoint whose next step is `step`."""

    step: int


def record_step(events: list, step: int, dp_size: int) -> None:
    """Append a completed step to the stored history `events`, extending the last run when it can."""
    last = events[-1] if events else None
    if last is not None and last[0] == "steps" and last[2] == step and last[3] == dp_size:
        last[2] = step + 1
    else:
        events.append(["steps", step, step + 1, dp_size])


_MASK64 = (1 << 64) - 1


def sample_events(samples: dict) -> list[list]:
    """History events for one commit's digests (rank -> [first, end, count, digest]): the dp
    replicas' reports summed, one event per distinct step range (one, unless a rank is wrong)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for first, end, count, digest in samples.values():
        total = groups.setdefault((int(first), int(end)), [0, 0])
        total[0] += int(count)
        total[1] = (total[1] + int(digest)) & _MASK64
    return [["samples", first, end, count, digest] for (first, end), (count, digest) in sorted(groups.items())]


def surviving_samples(events: Iterable[Sequence]) -> list[SampleReport]:
    """The sample reports whose steps survive in the final model, by first step (module docstring)."""
    kept: list[SampleReport] = []
    for event in events:
        if isinstance(event, Sequence) and len(event) == 5 and event[0] == "samples":
            kept.append(SampleReport(*(int(v) for v in event[1:])))
        elif isinstance(event, Restored) or (isinstance(event, Sequence) and len(event) == 2
                                              and event[0] == "restore"):
            step = event.step if isinstance(event, Restored) else int(event[1])
            kept = [k for k in kept if k.end <= step]
    newest: dict[int, SampleReport] = {}  # per generation (its first step): the report reaching furthest
    for k in kept:
        if k.first not in newest or k.end > newest[k.first].end:
            newest[k.first] = k
    return sorted(newest.values(), key=lambda k: k.first)


def surviving_history(events: Iterable[StepRecord | Restored | Sequence]) -> list[StepRecord]:
    """The step records whose updates are in the final model, in order.

    `events` may also hold plain tuples: `(step, dp_size)` or `(step, dp_size, samples)`
    for a step, `("restore", step)` for a restore, `("steps", first, end, dp_size)` for a run.
    """
    kept: list[StepRecord] = []
    for event in events:
        if isinstance(event, Sequence) and len(event) == 5 and event[0] == "samples":
            continue  # what the ranks consumed: surviving_samples
        event = _parse(event)
        if isinstance(event, Restored):
            kept = [record for record in kept if record.step < event.step]
        else:
            kept.extend(event)
    return kept


def _parse(event: StepRecord | Restored | Sequence) -> list[StepRecord] | Restored:
    """A restore, or the step records one event stands for (a run stands for several)."""
    if isinstance(event, Restored):
        return event
    if isinstance(event, StepRecord):
        return [event]
    if len(event) == 2 and event[0] == "restore":
        return Restored(int(event[1]))
    if len(event) == 4 and event[0] == "steps":
        first, end, dp_size = (int(v) for v in event[1:])
        return [StepRecord(step, dp_size) for step in range(first, end)]
    if len(event) in (2, 3):
        samples = None if len(event) == 2 or event[2] is None else tuple(tuple(ids) for ids in event[2])
        return [StepRecord(int(event[0]), int(event[1]), samples)]
    raise ValueError(f"history event {event!r} is neither (step, dp_size[, samples]), ('steps', first, end, "
                     "dp_size) nor ('restore', step)")
