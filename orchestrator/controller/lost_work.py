"""The work a failure's rollback throws away: booked from productive to lost_work (monitor.goodput).

A recovery books its rollback before it restores anything, against the step it expects to restore
(the newest commit, or a newer memory snapshot whose holders live), since a successor or a
chaos run reads the ledger meanwhile. The restore may then land older: the newest commit proves
corrupt or gone and an older one loads, a memory snapshot fails to load and storage is read, or
nothing loads and the job starts over. The steps between the two were trained and are redone, so
they are lost work too; unbooked, goodput would count them twice as productive.

Protocol (controller thread): `on_failure(failure, restore_point, trained_since)` in RECOVERING,
once the failure is attributed: books the failed generation's steps from `restore_point` on (and
the step in flight), returns the seconds; a recovery that follows a failed restore (nothing trained
since) books nothing and keeps the step the first recovery booked down to. `on_restored(failure, step)` in RESTORING
once the ranks restored `step` (None: a fresh start) for `failure`'s recovery: books the steps
from `step` to that booked step, and returns the words to append to the transition's sentence.
"""

from __future__ import annotations


class LostWork:
    def __init__(self, record, ledger):
        self.record, self.ledger = record, ledger
        self._booked_to: int | None = None  # the recovery's rollback is booked down to this step

    def on_failure(self, failure, restore_point: int, trained_since: float | None) -> float:
        """`trained_since`: the failed generation's training start (None: it never trained)."""
        if trained_since is None:  # a failure before training (rendezvous, restore) rolls back nothing new
            lost = 0.0
            # A failed restore's recovery: the steps down to the first recovery's point are booked already,
            # whatever older step this one expects; the restore that lands books the rest.
            if self._booked_to is None:
                self._booked_to = restore_point
        else:
            lost = self.record.rolled_back_seconds(restore_point, since=trained_since, failed_at=failure.onset)
            self._booked_to = restore_point
        lost = self.ledger.move(lost, "productive", "lost_work")  # as booked (clamped to what productive holds)
        failure.record.lost_work_s = lost
        return lost

    def on_restored(self, failure, step: int | None) -> str:
        booked_to, self._booked_to = self._booked_to, None
        restored = step or 0
        if failure is None or booked_to is None or restored >= booked_to:
            return ""
        more = self.ledger.move(self.record.work_seconds(restored, booked_to), "productive", "lost_work")
        failure.record.lost_work_s = (failure.record.lost_work_s or 0.0) + more
        return f"; older than step {booked_to} the recovery expected: {more:.2f} s more work to redo"
