"""The driver's record of the workers' steps, bounded: old committed steps are folded into their losses.

A parameter-server job's driver takes a StepLog per worker per step (paramserver.actors). Kept
whole, a long job's logs grow without bound: a million steps of eight workers are eight million
logs, gigabytes of driver memory, for a report that needs of the old ones only each step's loss
and the mean pull wait. So `StepLogs` keeps them whole up to `keep`, and past that folds the
oldest of the steps that only a rollback to step 0 undoes (those below the last commit; for a job
without checkpoints, whose rollbacks restart it at step 0, those every worker has passed), into
their token-weighted loss and the pull wait's sum and count, as paramserver.update_history folds
the update records. A log that never came (a worker killed between its pushes' acknowledgement and
its log's delivery; its replacement resumes after that step) does not hold the folding up.

Protocol (the supervisor's thread, paramserver.supervisor): a dict of (worker, step) -> the
surviving execution's StepLog, filled by `add(entry)`; `committed(step)` after each commit;
`rewind(step)` after a rollback to `step` has dropped the logs of the steps it threw away
(paramserver.recovery.record_rollback deletes them from this dict), which returns the executions
of folded steps it undid. At the end `losses()` gives
every step's loss, folded or kept, and `pull_wait()` the sum and count of every step's wait.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from paramserver.actors import StepLog

log = logging.getLogger(__name__)
KEEP = 1_000_000  # step logs kept whole (a few hundred MB); older committed steps are folded


class StepLogs(dict):
    def __init__(self, workers: int, keep: int = KEEP, foldable_below: float = 0):
        super().__init__()
        self.workers = workers
        self.keep = keep
        self.foldable_below = foldable_below  # steps below it are folded once `keep` is passed
        self.folded_first: int | None = None  # the first folded step; the lists hold it and the next ones
        self.folded_losses: list[float] = []
        self.folded_waits: list[float] = []  # each folded step's pull wait seconds, over its workers
        self.folded_counts: list[int] = []  # each folded step's worker executions
        self._newest: dict[int, int] = {}  # worker -> the newest step it logged
        self._fold_at = keep

    @property
    def folded_end(self) -> int:
        """Every folded step is below it (0 before any fold)."""
        return 0 if self.folded_first is None else self.folded_first + len(self.folded_losses)

    def add(self, entry: StepLog) -> None:
        self[(entry.worker, entry.step)] = entry
        self._newest[entry.worker] = max(entry.step, self._newest.get(entry.worker, -1))
        if len(self) > self._fold_at:
            self._fold()

    def committed(self, step: int) -> None:
        """`step` is committed: every worker finished the steps below it, and only a rollback to step 0
        undoes them."""
        self.foldable_below = step
        if len(self) > self.keep:
            self._fold()

    def rewind(self, step: int) -> int:
        """A rollback to `step`, after the kept logs from there on were dropped: folded steps from there
        on were undone too (a rollback to step 0, or to an older commit than the last one when the
        newest went missing). Returns their worker executions, which the rollback threw away too."""
        self._newest = {worker: min(newest, step - 1) for worker, newest in self._newest.items()}
        if step >= self.folded_end:
            return 0
        log.warning("the rollback to step %d undid steps already folded (below step %d)", step, self.folded_end)
        cut = max(0, step - (self.folded_first or 0))
        undone = sum(self.folded_counts[cut:])
        for folded in (self.folded_losses, self.folded_waits, self.folded_counts):
            del folded[cut:]
        if not self.folded_losses:
            self.folded_first = None
        return undone

    def _bound(self) -> float:
        """Steps below it may fold: the last commit's; for a job without checkpoints, those every worker
        has passed (a log that never came, a replaced worker's last, never will)."""
        if self.foldable_below != float("inf"):
            return self.foldable_below
        return min(self._newest.values()) if len(self._newest) >= self.workers else 0

    def _fold(self) -> None:
        """Fold the oldest foldable steps, whole steps at a time, until `keep` / 2 logs are kept."""
        bound, by_step = self._bound(), defaultdict(list)
        for (_, step), entry in self.items():
            if step < bound:
                by_step[step].append(entry)
        for step in sorted(by_step):
            if len(self) <= self.keep // 2:
                break
            entries = by_step[step]
            if self.folded_first is None:
                self.folded_first = step
            # A step with no log at all (every worker's lost) keeps its place: losses stay by step.
            for _ in range(step - self.folded_end):
                self._fold_step([])
            self._fold_step(entries)
        self._fold_at = max(self.keep, len(self) + self.keep // 2)  # no rescan at every step

    def _fold_step(self, entries: list[StepLog]) -> None:
        tokens = sum(e.tokens for e in entries)
        self.folded_losses.append(sum(e.loss_sum for e in entries) / tokens if tokens else float("nan"))
        self.folded_waits.append(sum(e.pull_wait_s for e in entries))
        self.folded_counts.append(len(entries))
        for entry in entries:
            del self[(entry.worker, entry.step)]

    def kept(self) -> list[StepLog]:
        """The logs kept whole, by (worker, step)."""
        return [self[key] for key in sorted(self)]

    def losses(self) -> list[float]:
        """Each step's token-weighted loss over every worker's share, from the first step the job ran."""
        return self.folded_losses + step_losses(self.kept())

    def pull_wait(self) -> tuple[float, int]:
        """(seconds, worker steps) of every surviving step's pull wait, folded or kept."""
        return (sum(self.folded_waits) + sum(e.pull_wait_s for e in self.values()),
                sum(self.folded_counts) + len(self))


def step_losses(logs: list[StepLog]) -> list[float]:
    """Each step's token-weighted loss over the workers' logs of it, in step order."""
    by_step: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    for entry in logs:
        by_step[entry.step][0] += entry.loss_sum
        by_step[entry.step][1] += entry.tokens
    return [by_step[s][0] / by_step[s][1] for s in sorted(by_step)]
