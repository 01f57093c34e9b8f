"""Saves that did not commit, in a row: at `checkpoint.max_failed_saves` of them the job fails.

One save that cannot commit does not stop training: it is logged, and the next one commits. A run
of `checkpoint.max_failed_saves` of them with no commit in between does (the store is not taking
checkpoints, and training on would keep nothing durable). A commit ends the run; a recovery does
not (its saves are as failed as before it). Both kinds of job count with this: a collective job
through orchestrator.controller.save_failures (which adds the metrics, the log and the saves
skipped through no failure), a parameter-server job's supervisor directly (paramserver.supervisor,
which also fails at its final save: `final=True`).

Protocol (one thread): `committed()` at each commit; `failed(step, reason)` at each save that did
not commit, raising `SavesFailing` at the limit and otherwise returning the words for the log.
"""

from __future__ import annotations


class SavesFailing(Exception):
    """`checkpoint.max_failed_saves` consecutive saves failed (or the final one did): training on
    would keep nothing durable, so the job fails (not a storage error of one request: never retried)."""


class FailedSaves:
    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []  # the steps of the saves failed since the last commit

    def committed(self) -> None:
        self.steps.clear()

    def failed(self, step: int, reason: object, *, final: bool = False, since: str = "") -> str:
        """Count the failed save of `step`; `since` (" and nothing was committed after step N") joins
        the error's words. Returns "k of checkpoint.max_failed_saves=L consecutive failures"."""
        self.steps.append(step)
        if final:
            raise SavesFailing(f"the final checkpoint (step {step}) was not committed ({reason}); a rerun resumes "
                               "from the last commit once the store takes writes")
        if len(self.steps) >= self.limit:
            raise SavesFailing(f"checkpoint storage failing: {len(self.steps)} consecutive saves failed (steps "
                               f"{', '.join(map(str, self.steps))}; checkpoint.max_failed_saves={self.limit})"
                               f"{since}; the last, step {step}: {reason}")
        return f"{len(self.steps)} of checkpoint.max_failed_saves={self.limit} consecutive failures"
