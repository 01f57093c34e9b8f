"""The driver's record of the workers' steps, bounded: old committed steps are folded into their losses.

A parameter-server job's driver takes a StepLog per worker per step (paramserver.actors). Kept
whole, a long job's logs grow without bound: a million steps of eight workers are eight million
logs, gigabytes of driver memory, for a report that needs of the old ones only each step's loss
and the mean pull wait. So `StepLogs` keeps them whole up to `keep`, and past that folds the
oldest of the steps that only a rollback to step 0 undoes (those below the last commit; every
step of a job without checkpoints, whose rollbacks restart it at step 0), into their
token-weighted loss and the pull wait's sum and count, as paramserver.update_history folds the
update records.

Protocol (the supervisor's thread, paramserver.supervisor): a dict of (worker, step) -> the
surviving execution's StepLog, filled by `add(entry)`; `committed(step)` after each commit;
`rewind(step)` after a rollback to `step` has dropped the logs of the steps it threw away
(paramserver.recovery.record_rollback deletes them from this dict). At the end `losses()` gives
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
        self.workers = workers  # a step folds only once every worker's log of it is in (asp workers drift apart)
        self.keep = keep
        self.foldable_below = foldable_below  # steps below it are folded once `keep` is passed
        self.folded_first: int | None = None  # the first folded step; `folded_losses` holds the next ones
        self.folded_losses: list[float] = []
        self.folded_wait = [0.0, 0]  # pull wait seconds, worker steps
        self._fold_at = keep

    @property
    def folded_end(self) -> int:
        """Every folded step is below it (0 before any fold)."""
        return 0 if self.folded_first is None else self.folded_first + len(self.folded_losses)

    def add(self, entry: StepLog) -> None:
        self[(entry.worker, entry.step)] = entry
        if len(self) > self._fold_at:
            self._fold()

    def committed(self, step: int) -> None:
        """`step` is committed: every worker finished the steps below it, and only a rollback to step 0
        undoes them."""
        self.foldable_below = step
        if len(self) > self.keep:
            self._fold()

    def rewind(self, step: int) -> None:
        """A rollback to `step`: folded steps from there on were undone too (a rollback to step 0, or to
        an older commit than the last one when the newest went missing)."""
        if step < self.folded_end:
            log.warning("the rollback to step %d undid steps already folded (below step %d); their losses are "
                        "dropped and the pull waits kept", step, self.folded_end)
            first = self.folded_first or 0
            del self.folded_losses[max(0, step - first):]
            if not self.folded_losses:
                self.folded_first = None

    def _fold(self) -> None:
        """Fold the oldest foldable steps, whole steps at a time, until `keep` / 2 logs are kept."""
        by_step: dict[int, list] = defaultdict(list)
        for (_, step), entry in self.items():
            if step < self.foldable_below:
                by_step[step].append(entry)
        for step in sorted(by_step):
            if len(self) <= self.keep // 2 or step != self.folded_end and self.folded_first is not None:
                break
            entries = by_step[step]
            if len(entries) < self.workers:  # a worker is still computing it: it and the later ones wait
                break
            if self.folded_first is None:
                self.folded_first = step
            self.folded_losses.append(sum(e.loss_sum for e in entries) / max(1, sum(e.tokens for e in entries)))
            self.folded_wait[0] += sum(e.pull_wait_s for e in entries)
            self.folded_wait[1] += len(entries)
            for entry in entries:
                del self[(entry.worker, entry.step)]
        self._fold_at = max(self.keep, len(self) + self.keep // 2)  # no rescan at every step

    def kept(self) -> list[StepLog]:
        """The logs kept whole, by (worker, step)."""
        return [self[key] for key in sorted(self)]

    def losses(self) -> list[float]:
        """Each step's token-weighted loss over every worker's share, from the first step the job ran."""
        return self.folded_losses + step_losses(self.kept())

    def pull_wait(self) -> tuple[float, int]:
        """(seconds, worker steps) of every surviving step's pull wait, folded or kept."""
        return (self.folded_wait[0] + sum(e.pull_wait_s for e in self.values()), self.folded_wait[1] + len(self))


def step_losses(logs: list[StepLog]) -> list[float]:
    """Each step's token-weighted loss over the workers' logs of it, in step order."""
    by_step: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    for entry in logs:
        by_step[entry.step][0] += entry.loss_sum
        by_step[entry.step][1] += entry.tokens
    return [by_step[s][0] / by_step[s][1] for s in sorted(by_step)]
