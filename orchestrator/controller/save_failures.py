"""Saves that will not commit in a collective job: logged, metered, and counted (ckpt.failed_saves).

A failed save (a failed shard write, a manifest commit that failed twice, shards that do not form
a checkpoint) counts against `checkpoint.max_failed_saves`; a run of them with no commit ends the
job. A save skipped through no failure (its step is kept from the history a restore left, or a
newer save replaced it before its manifest create began) is counted apart and never against it.

Protocol (controller thread; owned by orchestrator.controller.checkpoints.Checkpoints, which passes
`dropped` and `skipped` to its ckpt.commit.Committer): `dropped(step, reason)` for each failed save,
raising `SavesFailing` at the limit; `skipped(step, reason)`; `committed()` at each commit.
"""

from __future__ import annotations

from collections.abc import Callable

from ckpt.failed_saves import FailedSaves, SavesFailing

__all__ = ["SaveFailures", "SavesFailing"]


class SaveFailures:
    def __init__(self, limit: int, metrics, log: Callable[[str], None], latest: Callable[[], int | None]):
        self.run, self.metrics, self.log = FailedSaves(limit), metrics, log
        self.latest = latest  # the newest committed step, for the error's words

    def committed(self) -> None:
        self.run.committed()

    def skipped(self, step: int, reason: str) -> None:
        self.metrics.on_checkpoint_skipped(1)
        self.log(f"checkpoint step {step} is not committed: {reason}; the next save commits")

    def dropped(self, step: int, reason: str) -> None:
        self.metrics.on_checkpoint_failed()
        latest = self.latest()
        since = f" and nothing was committed {f'after step {latest}' if latest is not None else 'in this run'}"
        count = self.run.failed(step, reason, since=since)
        self.log(f"checkpoint step {step} will not be committed: {reason}; training goes on and the next save "
                 f"commits ({count})")
