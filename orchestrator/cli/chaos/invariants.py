"""The checks every chaos run ends with (docs/design.md sections 3, 4 and 7), each a `Check(name, ok, detail)`.

Protocol: when a chaos run has finished (SUCCEEDED or FAILED, ledger stopped, actors
released), the caller gathers what the run left and calls

    report = check_all(catalog=..., final=..., reference=..., history=..., final_step=...,
                       global_batch=..., goodput=ledger, pids=[...])

Every check whose inputs are given runs (one that raises becomes a failed check naming the
exception, so one broken input never hides the other verdicts); the others are listed in
`report.skipped`. `report.ok` is the verdict, `report.table()` the terminal lines and
`report.to_dict()` the JSON for the run report. The single checks are public, for tests
and tools that need only one:

* check_checkpoints_verify: every committed checkpoint verifies; names the bad ones.
  Steps the run corrupted on purpose (`expected_bad`) must fail, or corruption went unseen.
* check_newest_loads: the newest committed checkpoint (not corrupted on purpose) loads whole.
* check_model_matches: the final model equals the failure-free reference, bit for bit or
  within rtol/atol; names the worst tensor and its largest difference.
* check_data_once: steps 0..final-1 each survive exactly once, each consuming every sample
  of its global batch exactly once over its dp ranks (orchestrator.controller.step_history builds the input).
* check_goodput: the goodput buckets sum to the wall time of a clock kept apart from them
  (the ledger's own start-to-stop reading), none negative or unknown.
* check_no_process_left: none of the given PIDs (on this host) is still running.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ckpt.reader import load_checkpoint, verify_checkpoint
from monitor.goodput import BUCKETS, GoodputLedger
from orchestrator.controller.step_history import StepRecord, surviving_history, surviving_samples

_SHOWN = 5  # problems named in a detail line before "and N more"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class InvariantReport:
    checks: list[Check]
    skipped: list[str] = field(default_factory=list)  # checks whose inputs were not given

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def to_dict(self) -> dict:
        return {"ok": self.ok, "checks": [asdict(check) for check in self.checks], "skipped": list(self.skipped)}

    def table(self) -> str:
        width = max((len(check.name) for check in self.checks), default=0)
        lines = [f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in self.checks]
        lines += [f"SKIP  {name:<{width}}  input not given" for name in self.skipped]
        return "\n".join(lines)


def _listing(items: list, more: str = "") -> str:
    shown = ", ".join(str(i) for i in items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more{more}" if len(items) > _SHOWN else "")


def check_checkpoints_verify(catalog, expected_bad: Iterable[int] = ()) -> Check:
    """(a) Every committed checkpoint of `catalog` verifies, except `expected_bad`, which must not."""
    expected, bad, missed = set(expected_bad), [], []
    steps = catalog.committed_steps()
    for step in steps:
        try:
            verify_checkpoint(catalog, step)
        except Exception as err:  # CorruptCheckpoint, UnsupportedManifest, I/O: all unusable
            if step not in expected:
                bad.append(f"step {step} ({type(err).__name__}: {err})")
        else:
            if step in expected:
                missed.append(step)
    problems = ([f"corrupt: {_listing(bad)}"] if bad else []) + (
        [f"corrupted on purpose but verifies: steps {_listing(missed)}"] if missed else [])
    if problems:
        return Check("checkpoints_verify", False, "; ".join(problems))
    return Check("checkpoints_verify", True, f"{len(steps)} committed checkpoints, steps {_listing(steps)}; "
                 f"{len(expected & set(steps))} corrupted on purpose and caught")


def check_newest_loads(catalog, expected_bad: Iterable[int] = ()) -> Check:
    """(b) The newest committed checkpoint not corrupted on purpose loads, every tensor."""
    excluded = set(expected_bad)
    steps = [s for s in catalog.committed_steps() if s not in excluded]
    if not steps:
        return Check("newest_loads", False, "no committed checkpoint to load")
    try:
        tensors, manifest = load_checkpoint(catalog, steps[-1])
    except Exception as err:
        return Check("newest_loads", False, f"step {steps[-1]}: {type(err).__name__}: {err}")
    return Check("newest_loads", True, f"step {manifest.step}: {len(tensors)} tensors")


def _difference(a: torch.Tensor, b: torch.Tensor, exact: bool, rtol: float, atol: float) -> tuple[bool, float]:
    """(equal?, largest absolute difference; inf where NaN meets a number)."""
    a64, b64 = a.detach().cpu().double(), b.detach().cpu().double()
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    diff = (a64 - b64).abs().nan_to_num(nan=math.inf)
    diff[nan_a & nan_b] = 0.0
    largest = float(diff.max()) if diff.numel() else 0.0
    if exact:
        # Bit for bit: the stored bytes, so -0.0 != 0.0 and NaN payloads count.
        raw = [t.detach().cpu().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        return torch.equal(*raw), largest
    # atol at the tensor's own scale: a fixed 1e-6 would pass any Adam second moment (about 1e-8 and less).
    largest_ref = float(b64.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).max()) if b64.numel() else 0.0
    scale = min(1.0, largest_ref) if largest_ref > 0 else 1.0  # (an all-zero tensor: the atol as given)
    return bool(torch.isclose(a64, b64, rtol=rtol, atol=atol * scale).all()), largest


def check_model_matches(
    final: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *, exact: bool = True,
    rtol: float = 1e-5, atol: float = 1e-8,
) -> Check:
    """(c) `final` equals `reference` (name -> logical tensor): bit for bit, or within rtol/atol."""
    name = "model_matches_reference"
    missing, extra = sorted(set(reference) - set(final)), sorted(set(final) - set(reference))
    if missing or extra:
        return Check(name, False, f"tensor names differ: missing {_listing(missing)}; unexpected {_listing(extra)}")
    shapes = [f"{n} {final[n].dtype}{list(final[n].shape)} vs {reference[n].dtype}{list(reference[n].shape)}"
              for n in sorted(reference)
              if final[n].shape != reference[n].shape or final[n].dtype != reference[n].dtype]
    if shapes:
        return Check(name, False, f"dtype/shape differ: {_listing(shapes)}")
    unequal, worst, worst_diff = [], None, -1.0
    for tensor in sorted(reference):
        equal, largest = _difference(final[tensor], reference[tensor], exact, rtol, atol)
        if not equal:
            unequal.append(tensor)
        if largest > worst_diff:
            worst, worst_diff = tensor, largest
    mode = "bit for bit" if exact else f"rtol={rtol:g}, atol={atol:g}"
    detail = f"worst {worst}: max |diff| {worst_diff:.3g}" if worst is not None else "no tensors"
    if unequal:
        return Check(name, False, f"{len(unequal)} of {len(reference)} tensors differ ({mode}): "
                     f"{_listing(unequal)}; {detail}")
    return Check(name, True, f"{len(reference)} tensors equal ({mode}); {detail}")


def _sample_ids(cursor, record: StepRecord, global_batch: int) -> list[int]:
    if record.samples is not None:
        return [i for ids in record.samples for i in ids]
    return [i for r in range(record.dp_size) for i in cursor.sample_ids(record.step, global_batch, r, record.dp_size)]


def reported_sample_problems(history: list, *, final_step: int, global_batch: int, cursor) -> list[str] | None:
    """What is wrong with the samples the ranks reported consuming (orchestrator.controller.step_history:
    surviving_samples), against the samples `cursor`'s schedule assigns to steps 0..final_step-1;
    [] when they match exactly; None when the history holds no report (written by an older release)."""
    from trainer.batch import SampleDigest

    if not any(isinstance(e, Sequence) and len(e) == 5 and e[0] == "samples" for e in history):
        return None
    reports = surviving_samples(history)
    problems, expected_first = [], 0
    for report in reports:
        if report.first != expected_first:
            problems.append(f"reports cover steps from {report.first}, expected from {expected_first}")
        want = SampleDigest.of(report.first, [cursor.sample_keys(s, global_batch) for s in range(report.first,
                                                                                                report.end)])
        if (report.count, report.digest) != (want.count, want.total):
            problems.append(f"steps {report.first}..{report.end - 1}: the ranks consumed {report.count} samples "
                            f"(digest {report.digest:#x}), the schedule assigns {want.count} (digest {want.total:#x})")
        expected_first = report.end
    if expected_first != final_step:
        problems.append(f"reports end at step {expected_first}, the job at {final_step}")
    return problems


def check_data_once(history: Iterable, *, final_step: int, global_batch: int, cursor=None,
                    reports_required: bool = False) -> Check:
    """(d) Steps 0..final_step-1 each survive once, each consuming range(global_batch) exactly once.

    The samples are checked against what the ranks reported consuming (their digests, summed per
    commit) when the history holds reports; otherwise derived from the layout (older histories),
    which can only agree with itself: `reports_required` (a run of this release, which always
    reports) makes a history without them a failure.

    `history`: the surviving step records (orchestrator.controller.step_history.surviving_history), or the whole
    recorded event list, which is reduced to them here (already-surviving input is unchanged
    by that). `cursor`: the job's cursor (trainer.data.make_cursor): the ids of a prepared
    dataset's samples are its windows, those of synthetic and text samples their global
    index; a synthetic one is built when not given.
    """
    name = "data_exactly_once"
    if cursor is None:
        from trainer.config import DataConfig
        from trainer.data import DataCursor

        cursor = DataCursor(DataConfig(), vocab_size=2)
    history = list(history)
    records = surviving_history(history)
    counts: dict[int, int] = {}
    for record in records:
        counts[record.step] = counts.get(record.step, 0) + 1
    missing = [s for s in range(final_step) if s not in counts]
    repeated = sorted(s for s, n in counts.items() if n > 1)
    beyond = sorted(s for s in counts if not 0 <= s < final_step)
    wrong = []
    for record in records:
        try:
            ids = _sample_ids(cursor, record, global_batch)
        except ValueError as err:
            wrong.append(f"step {record.step} (dp={record.dp_size}: {err})")
            continue
        if sorted(ids) != list(range(global_batch)):
            twice = sorted(i for i, n in Counter(ids).items() if n > 1)
            unseen = sorted(set(range(global_batch)) - set(ids))
            wrong.append(f"step {record.step} (dp={record.dp_size}: repeated samples {_listing(twice)}, "
                         f"skipped {_listing(unseen)})")
    problems = [f"{label} {_listing(items)}" for label, items in (
        ("steps never applied:", missing), ("steps applied twice:", repeated),
        ("steps outside 0..final-1:", beyond), ("wrong samples in", wrong)) if items]
    reported = reported_sample_problems(history, final_step=final_step, global_batch=global_batch, cursor=cursor)
    problems += reported or []
    if reported is None and reports_required:
        problems.append("the ranks reported no sample digests (this release's commits carry them): what they "
                        "consumed was not checked, only the layouts' arithmetic")
    if problems:
        return Check(name, False, "; ".join(problems))
    layouts = sorted({r.dp_size for r in records})
    evidence = "as the ranks reported them" if reported is not None else "derived from the layouts"
    return Check(name, True, f"steps 0..{final_step - 1} once each, {global_batch} samples each ({evidence}), "
                             f"dp sizes {layouts}")


def check_goodput(goodput: GoodputLedger | Mapping[str, float], *, wall_s: float | None = None,
                  tol_s: float = 1e-3, rel_tol: float = 1e-6) -> Check:
    """(e) The buckets sum to wall time within max(tol_s, rel_tol * wall), none negative or unknown.

    `goodput`: the ledger (stop it first, so totals and wall are read at one instant) or its
    `to_dict()`; with a dict, `wall_s` is required (the dict has no wall of its own). The wall
    must come from a clock, never from the buckets: a report's `goodput.wall_s` is their sum
    (the check would pass whatever they hold); its `goodput.clock_wall_s` is the ledger's clock.
    The ledger conserves time by construction (every move takes what it gives), so this checks
    its bookkeeping as the report carries it (buckets dropped, negative, unknown, a carry gone
    wrong); time lost or invented against the world is `check_wall_within`'s, by an outside clock.
    """
    name = "goodput_sums_to_wall"
    if isinstance(goodput, GoodputLedger):
        totals, wall = goodput.totals(), goodput.wall() if wall_s is None else wall_s
    else:
        if wall_s is None:
            return Check(name, False, "a goodput dict needs wall_s: the job's wall seconds by a clock "
                         "(a report's goodput.clock_wall_s; reports of older releases have none)")
        totals, wall = dict(goodput), wall_s
    unknown = sorted(set(totals) - set(BUCKETS))
    negative = sorted(b for b, s in totals.items() if not s >= 0.0)  # NaN included
    booked = sum(totals.values())
    gap = booked - wall
    problems = ([f"unknown buckets {unknown}"] if unknown else []) + (
        [f"negative or NaN buckets {negative}"] if negative else [])
    if not abs(gap) <= max(tol_s, rel_tol * abs(wall)):
        problems.append(f"buckets sum to {booked:.6f} s but wall is {wall:.6f} s (off by {gap:+.6f} s)")
    if problems:
        return Check(name, False, "; ".join(problems))
    share = totals.get("productive", 0.0) / wall if wall > 0 else 0.0
    return Check(name, True, f"{booked:.3f} s booked of {wall:.3f} s wall; goodput {share:.1%}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # a zombie has exited and only waits to be reaped; stopped counts as alive


def check_no_process_left(pids: Iterable[int] | Mapping[str, int], elsewhere: int = 0) -> Check:
    """(f) None of `pids` (or {label: pid}) is still running on this host; a stopped (hung) one counts.
    `elsewhere` rank processes ran on other hosts: unchecked (this host's /proc), and the line says so."""
    labelled = dict(pids) if isinstance(pids, Mapping) else {f"pid {p}": p for p in pids}
    alive = [f"{label} ({pid})" if not label.startswith("pid ") else label
             for label, pid in labelled.items() if _alive(int(pid))]
    if alive:
        return Check("no_process_left", False, f"{len(alive)} of {len(labelled)} still running: {_listing(alive)}")
    unseen = f"; {elsewhere} on other hosts not checked (this host's /proc only)" if elsewhere else ""
    return Check("no_process_left", True, f"{len(labelled)} processes on this host all gone{unseen}")


def check_all(
    *, catalog=None, expected_bad: Iterable[int] = (), final: Mapping[str, torch.Tensor] | None = None,
    reference: Mapping[str, torch.Tensor] | None = None, exact: bool = True, rtol: float = 1e-5, atol: float = 1e-8,
    history: Iterable | None = None, final_step: int | None = None, global_batch: int | None = None, cursor=None,
    goodput: GoodputLedger | Mapping[str, float] | None = None, wall_s: float | None = None,
    pids: Iterable[int] | Mapping[str, int] | None = None, pids_elsewhere: int = 0, reports_required: bool = False,
) -> InvariantReport:
    """Run every check whose inputs are given (see module doc) and return the report; `reports_required`:
    check_data_once's (a run of this release)."""
    expected_bad = list(expected_bad)
    plan: list[tuple[str, bool, Callable[[], Check]]] = [
        ("checkpoints_verify", catalog is not None, lambda: check_checkpoints_verify(catalog, expected_bad)),
        ("newest_loads", catalog is not None, lambda: check_newest_loads(catalog, expected_bad)),
        ("model_matches_reference", final is not None and reference is not None,
         lambda: check_model_matches(final, reference, exact=exact, rtol=rtol, atol=atol)),
        ("data_exactly_once", history is not None and final_step is not None and global_batch is not None,
         lambda: check_data_once(history, final_step=final_step, global_batch=global_batch, cursor=cursor,
                                 reports_required=reports_required)),
        ("goodput_sums_to_wall", goodput is not None, lambda: check_goodput(goodput, wall_s=wall_s)),
        ("no_process_left", pids is not None, lambda: check_no_process_left(pids, pids_elsewhere)),
    ]
    checks, skipped = [], []
    for name, given, run in plan:
        if not given:
            skipped.append(name)
            continue
        try:
            checks.append(run())
        except Exception as err:  # a check that cannot run has not passed
            checks.append(Check(name, False, f"check could not run: {type(err).__name__}: {err}"))
    return InvariantReport(checks, skipped)
