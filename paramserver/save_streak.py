"""Parameter-server saves that do not commit: a run of them, or the final one, ends the job.

As in a collective job (orchestrator.controller.save_failures), one save that cannot commit does not
stop training: it is logged and the next one commits. A run of `checkpoint.max_failed_saves` of them
with no commit in between does (the store is not taking checkpoints, and training on would keep
nothing durable), and so does the final step's: a job that ends without its last state committed
has not succeeded, and a rerun resumes at the last commit.

Protocol (the supervisor's thread, paramserver.supervisor.Supervisor._save): `committed()` at each
commit, `failed(step, final, reason)` at each save that did not commit, raising `SavesFailing`.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class SavesFailing(RuntimeError):
    """The final save, or `checkpoint.max_failed_saves` in a row, did not commit: the job fails."""


class SaveStreak:
    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []  # the steps of the saves failed since the last commit

    def committed(self) -> None:
        self.steps.clear()

    def failed(self, step: int, final: bool, reason: object) -> None:
        self.steps.append(step)
        if final:
            raise SavesFailing(f"the final checkpoint (step {step}) was not committed ({reason}); a rerun resumes "
                               "from the last commit once the store takes writes")
        if len(self.steps) >= self.limit:
            raise SavesFailing(f"checkpoint storage failing: {len(self.steps)} consecutive saves failed (steps "
                               f"{', '.join(map(str, self.steps))}; checkpoint.max_failed_saves={self.limit}); "
                               f"the last, step {step}: {reason}")
        log.warning("checkpoint step %d was not committed (%s); training goes on and the next save commits "
                    "(%d of checkpoint.max_failed_saves=%d consecutive failures)", step, reason, len(self.steps),
                    self.limit)
