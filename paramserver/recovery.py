"""The supervisor's decisions, without Ray: segments, where a replaced worker resumes, which faults fire, what failed.

Pure functions and records that paramserver.supervisor calls from its loop (and unit tests call
with plain values):
  * `segment_end(step, steps, every)`: where the segment starting at `step` ends (the next
    checkpoint cut);
  * `resume_step(clocks, worker)`: the step a replacement of `worker` starts at, from every
    server's clocks, or None when the servers disagree (a torn push);
  * `FaultPlan`: the injected faults (kill_rank as `Fault("worker", w, step)`, kill_server as
    `Fault("server", k, step)`, hang_rank and hang_server as "worker_hang" and "server_hang"), the
    pull holds that place them, each fired at most once per job;
  * `Failure`: one failure and what the supervisor did about it, as the report shows it;
  * `SegmentStarts`: the productive seconds booked at each segment's start, for the work a rollback
    to an older segment's start throws away;
  * `Ledger`: the goodput ledger's interface (monitor.goodput.GoodputLedger, which the caller
    passes in: this layer does not import monitor) and `NullLedger` when none is kept.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

# The goodput ledger's buckets this package books into (monitor.goodput.BUCKETS).
PRODUCTIVE, STARTUP, SAVE, RESTORE = "productive", "startup", "checkpoint_save", "checkpoint_restore"
DETECTION, REFORMATION, LOST, OTHER = "detection", "reformation", "lost_work", "other"
WORKER_FAULTS, SERVER_FAULTS = ("worker", "worker_hang"), ("server", "server_hang")  # Fault kinds by target


def segment_end(step: int, steps: int, every: int | None) -> int:
    """The end (exclusive) of the segment that starts at `step`: the next multiple of `every`
    (the checkpoint cadence), or `steps`; one segment when `every` is None."""
    if every is None:
        return steps
    return min(steps, (step // every + 1) * every)


def resume_step(clocks: list[list[int]], worker: int) -> int | None:
    """The step `worker`'s replacement starts at: its clock on every server (each server counts
    the steps it pushed there), or None when they differ: the worker died between its pushes of
    one step to two servers, which no replay can complete exactly (a server that has the push may
    already have applied it)."""
    seen = {server_clocks[worker] for server_clocks in clocks}
    return seen.pop() if len(seen) == 1 else None


@dataclass(frozen=True)
class Fault:
    """An injected fault: kill worker `target` (or stop it: a hang) as it is about to pull `at_step`,
    or kill (stop) server `target` once every worker has pushed `at_step` steps to it."""

    kind: str  # "worker" | "server" | "worker_hang" | "server_hang" (the process stops, alive: SIGSTOP)
    target: int
    at_step: int

    def __post_init__(self):
        if self.kind not in (*WORKER_FAULTS, *SERVER_FAULTS):
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(WORKER_FAULTS + SERVER_FAULTS)}")

    @property
    def hang(self) -> bool:
        return self.kind.endswith("_hang")

    @property
    def actor(self) -> str:
        """What it acts on: "worker" or "server"."""
        return "worker" if self.kind in WORKER_FAULTS else "server"


class FaultPlan:
    """The job's injected faults; each fires once (a rolled-back segment that passes its step
    again does not fire it again). They land at exact points through pull holds (paramserver.gate):
    a worker's kill or hang holds that worker's pull of at_step on server 0 (it has pushed every earlier step
    everywhere and nothing of at_step); a server's kill or hang holds every worker's pull of at_step on that
    server (every worker has pushed at_step steps to it, and no more)."""

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = ()):
        self.faults = list(faults)
        self.fired: set[int] = set()

    def pending(self, start: int, end: int) -> list[tuple[int, Fault]]:
        """(id, fault) not fired yet whose step lies in the segment [start, end)."""
        return [(i, f) for i, f in enumerate(self.faults) if i not in self.fired and start <= f.at_step < end]

    def holds(self, start: int, end: int, workers: int) -> list[tuple[int, int, int]]:
        """(server, worker, step): the pulls to hold for this segment's faults."""
        out = []
        for _, fault in self.pending(start, end):
            if fault.actor == "worker":
                out.append((0, fault.target, fault.at_step))
            else:
                out += [(fault.target, w, fault.at_step) for w in range(workers)]
        return out

    def due(self, server: int, held: list[tuple[int, int]], start: int, end: int, workers: int) -> list[int]:
        """Ids of the faults due now that `server` holds the pulls `held` [(worker, step)]."""
        waiting = set(held)
        return [i for i, f in self.pending(start, end)
                if (f.actor == "worker" and server == 0 and (f.target, f.at_step) in waiting)
                or (f.actor == "server" and server == f.target and all((w, f.at_step) in waiting
                                                                       for w in range(workers)))]

    def fire(self, fault_id: int) -> Fault:
        self.fired.add(fault_id)
        return self.faults[fault_id]


@dataclass
class Failure:
    """One failure and the repair. kind: "worker" (its actor died), "server" (its actor died) or
    "torn_push" (a worker died between two servers' pushes of one step). action: "replaced" (a new
    worker resumed where the servers had it, no other actor touched) or "restored" (every server
    restored from checkpoint `restored_step`, or reset to the initial values when
    `from_checkpoint` is false, and the segment redone)."""

    kind: str
    target: int
    detected_at: float  # time.time()
    action: str
    injected_at: float | None = None  # when the supervisor killed it (injected faults)
    resumed_at: int | None = None  # replaced: the replacement's first step; restored: the restored step
    pause_s: float | None = None  # replaced: detection -> the replacement's first acknowledged push
    steps_redone: int = 0  # restored: steps finished since the restored step, executed again
    from_checkpoint: bool = True
    reason: str = ""  # restored: what stopped the segment
    pids: dict[str, int] = field(default_factory=dict)  # "old" / "new" process of the replaced worker
    hung: str = ""  # killed by the hang watchdog (paramserver.hang_watch): what it saw
    rollback: int = 0  # restored: which rollback of the job (1, 2, ...): one rollback's entries share it

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        what = {"torn_push": f"worker {self.target} died between its pushes of one step to two servers",
                "run_error": self.reason or "a worker's run failed"}.get(self.kind, f"{self.kind} {self.target} died")
        what = f"{self.hung} (hung)" if self.hung else what
        if self.action == "replaced":
            pause = f"{self.pause_s:.2f} s" if self.pause_s is not None else "not measured"
            return f"{what}: replaced, resumed at step {self.resumed_at}, pause {pause}, no global restart"
        source = f"checkpoint step {self.resumed_at}" if self.from_checkpoint else "the initial values (step 0)"
        return f"{what}: every server restored from {source}, {self.steps_redone} steps redone"


class SegmentStarts:
    """The ledger's productive total at the start of each segment of this run (the supervisor calls
    `begin` as a segment starts and `redone` once a rollback knows the step it restored): a rollback
    books the current segment's work as lost itself, and `redone` gives what the segments between the
    restored step and the current one trained (a save that failed, a corrupt newest commit skipped)."""

    def __init__(self):
        self._at: dict[int, float] = {}  # segment start step -> productive seconds booked then
        self.current = 0.0  # ... at the start of the segment under way

    def begin(self, step: int, productive: float) -> float:
        """A segment starts at `step`: starts above it were rolled back; `productive` is returned."""
        self._at = {s: p for s, p in self._at.items() if s < step}
        self._at[step] = self.current = productive
        return productive

    def redone(self, step: int) -> float:
        """Productive seconds from the start of the segment at restored `step` (this run's first segment
        for a step older than every start: what earlier runs trained is carried, not this run's to book)
        to the start of the segment under way."""
        if not self._at or step >= max(self._at):
            return 0.0
        base = self._at.get(step, self._at[min(self._at)])
        return max(0.0, self.current - base)


class Ledger(Protocol):
    def enter(self, bucket: str) -> None: ...
    def move(self, seconds: float, src: str, dst: str) -> float: ...
    def totals(self) -> dict[str, float]: ...
    def stop(self) -> None: ...
    def wall(self) -> float: ...


class NullLedger:
    """No goodput kept (a caller that passed no ledger)."""

    def enter(self, bucket: str) -> None:
        pass

    def move(self, seconds: float, src: str, dst: str) -> float:
        return 0.0

    def totals(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass

    def wall(self) -> float:
        return 0.0


def steps_redone(failures: list[Failure]) -> int:
    """The steps the job's rollbacks redid, each rollback once (its entries, a dead server or torn push
    each, carry the same count)."""
    return sum({f.rollback: f.steps_redone for f in failures if f.rollback}.values())


def record_rollback(failures: list[Failure], logs: dict, dead: set[int], reason: str, detected: float,
                    injected: float | None, step: int, from_checkpoint: bool,
                    hung: dict[int, str] | None = None) -> int:
    """Book a rollback to `step` (paramserver.supervisor): drop the logs of the steps it threw away,
    mark the torn pushes pending and each dead server restored in `failures` (`hung`: the servers
    killed as hung, and why); returns the step executions thrown away."""
    lost = [key for key in logs if key[1] >= step]
    redone = max((s for _, s in lost), default=step - 1) + 1 - step
    for key in lost:
        del logs[key]
    torn = [f for f in failures if f.action == "pending"]
    entries = torn + [Failure("server", k, detected, "restored", injected, hung=(hung or {}).get(k, ""))
                      for k in sorted(dead)]
    rollback = 1 + max((f.rollback for f in failures), default=0)
    for failure in entries or [Failure("run_error", -1, detected, "restored")]:
        failure.action, failure.resumed_at, failure.steps_redone = "restored", step, redone
        failure.rollback = rollback
        failure.from_checkpoint, failure.reason = from_checkpoint, reason
        if not any(f is failure for f in failures):
            failures.append(failure)
    log.warning("%s: every server restored to step %d (%s), %d steps redone", reason, step,
                "checkpoint" if from_checkpoint else "initial values", redone)
    return len(lost)
