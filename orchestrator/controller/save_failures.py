"""Saves that will not commit: logged and counted, and a run of them with no commit ends the job.

A save that cannot commit does not stop the job by itself: it is logged, counted, and the next one
commits. Only a run of `checkpoint.max_failed_saves` of them with no commit in between does (a
failed shard write, a manifest commit that failed twice, shards that do not form a checkpoint):
the storage is not taking checkpoints, and training on would keep nothing durable. A commit
resets the count; a recovery does not (its saves are as failed as before it). A save skipped
through no failure (its step is kept from the history a restore left, or a newer save replaced it
before its manifest create began) is counted apart and never against the limit.

Protocol (controller thread; owned by orchestrator.controller.checkpoints.Checkpoints, which passes
`dropped` and `skipped` to its ckpt.commit.Committer): `dropped(step, reason)` for each failed save,
raising `SavesFailing` at the limit; `skipped(step, reason)`; `committed()` at each commit.
"""

from __future__ import annotations

from collections.abc import Callable


class SavesFailing(Exception):
    """`checkpoint.max_failed_saves` consecutive saves failed: training on would keep nothing
    durable, so the job fails (not a storage error of one request: fatal, never retried)."""


class SaveFailures:
    def __init__(self, limit: int, metrics, log: Callable[[str], None], latest: Callable[[], int | None]):
        self.limit, self.metrics, self.log = limit, metrics, log
        self.latest = latest  # the newest committed step, for the error's words
        self.steps: list[int] = []  # the steps of the saves failed since the last commit

    def committed(self) -> None:
        self.steps.clear()

    def skipped(self, step: int, reason: str) -> None:
        self.metrics.on_checkpoint_skipped(1)
        self.log(f"checkpoint step {step} is not committed: {reason}; the next save commits")

    def dropped(self, step: int, reason: str) -> None:
        self.metrics.on_checkpoint_failed()
        self.steps.append(step)
        if len(self.steps) < self.limit:
            self.log(f"checkpoint step {step} will not be committed: {reason}; training goes on and the next save "
                     f"commits ({len(self.steps)} of checkpoint.max_failed_saves={self.limit} consecutive failures)")
            return
        latest = self.latest()
        since = f"after step {latest}" if latest is not None else "in this run"
        raise SavesFailing(f"checkpoint storage failing: {len(self.steps)} consecutive saves failed (steps "
                           f"{', '.join(map(str, self.steps))}; checkpoint.max_failed_saves={self.limit}) "
                           f"and nothing was committed {since}; the last, step {step}: {reason}")
