"""The failures a job's earlier runs made, carried into this run's restart budget.

A failed driver is often run again by what supervises it (KubeRay's `backoffLimit`, a Slurm
requeue, a shell loop, a person). `elastic.max_restarts` counts the recoveries of the *job*
within `elastic.restart_window_s`, and `elastic.crash_loop_limit` the same failure in a row: if
each rerun started both from nothing, a job that fails deterministically would recover forever,
its budget renewed by every rerun. So the failures are recorded with the goodput snapshot the
controller rewrites every few seconds and when it ends (orchestrator.controller.ledger_snapshot:
a job that fails writes its last one as it stops), and the next run starts its history with them.

Protocol (the controller, at construction, before it places anything): `carry_failures(snapshots,
policy)` returns the failure history this run starts with (the earlier runs' failures that can
still count: within the window; a snapshot keeps at most a budget's worth), and makes every later snapshot
record that list as it grows. The policy then counts them as its own, and its message says how
many were earlier runs'. A snapshot that cannot be read carries nothing (LedgerSnapshots.load):
the budget is then this run's alone, as before any was recorded.
"""

from __future__ import annotations

import time

from orchestrator.controller.policies import FailurePolicy, FailureSummary


def carry_failures(snapshots, policy: FailurePolicy, now: float | None = None) -> list[FailureSummary]:
    """This run's failure history, seeded from the newest snapshot; `snapshots.failures` records it."""
    snapshot = snapshots.held = snapshots.load()  # (held as it is until this run carries it)
    history = earlier_failures(snapshot.get("failures", []) if snapshot else [], policy,
                               time.time() if now is None else now)
    snapshots.failures = lambda: saved_failures(history, policy)
    return history


def saved_failures(history: list[FailureSummary], policy: FailurePolicy) -> list[dict]:
    """The failures a successor may count: the last ones a budget or a crash loop can reach."""
    keep = policy.max_restarts + policy.crash_loop_limit
    return [{"kind": f.kind, "rank": f.rank, "step": f.step, "error": f.error, "at": f.at,
             "injected_machine_fault": f.injected_machine_fault} for f in history[-keep:]]


def earlier_failures(saved: list, policy: FailurePolicy, now: float) -> list[FailureSummary]:
    """`saved` (a snapshot's) as FailureSummary marked `earlier_run`, those out of the window dropped;
    an entry that does not parse is skipped (the snapshot is telemetry, written by any release)."""
    out = []
    for entry in saved if isinstance(saved, list) else []:
        try:
            failure = FailureSummary(kind=str(entry.get("kind", "failure")), rank=_int_or_none(entry.get("rank")),
                                     step=_int_or_none(entry.get("step")), error=str(entry.get("error", "")),
                                     at=float(entry["at"]),
                                     injected_machine_fault=bool(entry.get("injected_machine_fault", False)),
                                     earlier_run=True)
        except (AttributeError, KeyError, TypeError, ValueError):
            continue
        if policy.window_s is None or failure.at > now - policy.window_s:
            out.append(failure)
    return out


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)
