"""The update records of a parameter-server job: each server's outbox, and the driver's history.

A server records every update it applies (paramserver.clocks.UpdateRecord: workers x servers of
them per step). Shipping every server's whole list at each stats poll (every second) and keeping
it whole on both sides made the poll and the memory grow with the job: a million records are
45 MB and 2.7 s of pickling per poll, within hours of a small job. So a server keeps only the
records the driver has not yet acknowledged (`RecordOutbox`), and the driver keeps them
(`UpdateHistory`), folding the ones no rollback can undo into counts once it holds `keep`.

Protocol. The server actor (paramserver.actors.ServerActor) hands `RecordOutbox.take(acked,
shard.records)` its shard's new records at each `stats(acked)` call and answers with every
record not yet acknowledged and the newest batch number; `drop_from(step)` at its `reopen` after
a restore. The supervisor (paramserver.supervisor) owns one `UpdateHistory`: during a segment
`ask(servers)` at each metrics poll and `answered()` at each turn of its loop, which never wait
(a stopped server must not hold the loop that finds it hung); `poll(servers)` for the metrics
outside one (None when a server did not answer: its batch waits for the next call, nothing is
lost), `drain(servers)` before each save (every record of the steps before the cut, so that a
server lost after the commit loses none; a dead server raises, as the save would), `rewind(step)`
after a rollback's restore (the updates of `step` and later were undone), `committed(step)` after
each commit. Every answer's new records go to `on_stats` once (monitor.ps_metrics); an update a
rollback undid before any answer carried it is never seen.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from paramserver.clocks import UpdateRecord

log = logging.getLogger(__name__)
KEEP = 1_000_000  # records kept whole on the driver (about 200 MB); older committed ones are counted
POLL_TIMEOUT_S = 10.0  # a metrics poll that waits longer is dropped (the progress polls find a dead server)


class RecordOutbox:
    """A server's update records not yet acknowledged by the driver, in numbered batches."""

    def __init__(self) -> None:
        self.batch = 0  # the newest batch's number; a new actor starts again from 0
        self.pending: list[tuple[int, list[UpdateRecord]]] = []

    def take(self, acked: int, new: list[UpdateRecord]) -> list[UpdateRecord]:
        """Forget the batches up to `acked` (the driver has them), add `new` as the next batch, and
        return every record still unacknowledged: a batch whose answer was lost is sent again."""
        self.pending = [(number, records) for number, records in self.pending if number > acked]
        if new:
            self.batch += 1
            self.pending.append((self.batch, new))
        return [r for _, records in self.pending for r in records]

    def drop_from(self, step: int) -> None:
        """The updates of `step` and later were undone by a restore."""
        self.pending = [(number, [r for r in records if r.step < step]) for number, records in self.pending]


class UpdateHistory:
    """Every update the job's servers applied and no rollback undid, as the driver fetched them.

    `foldable_below`: records of steps below it can be undone only by a rewind to step 0: the
    last commit (`committed`), or every step for a job without checkpoints (a rollback restarts it
    from step 0). Past `keep` records those are folded into staleness counts, the oldest first."""

    def __init__(self, on_stats: Callable[[list], object] | None = None, keep: int = KEEP,
                 foldable_below: float = 0):
        self.on_stats, self.keep, self.foldable_below = on_stats, keep, foldable_below
        self.kept: list[UpdateRecord] = []  # in the order fetched
        self.folded: Counter[int] = Counter()  # staleness -> updates no longer kept whole
        self.folded_below = 0  # every folded record's step is below it
        self.last: dict[int, object] = {}  # server index -> its newest ServerStats (version, bytes)
        self._last_actor: dict[int, object] = {}  # server index -> the actor that answered `last`
        # server index -> bytes its replaced actors had moved by their last answers (a new actor counts from 0)
        self._retired: Counter[int] = Counter()
        self._acked: dict[object, int] = {}  # server actor handle -> the newest batch taken from it
        self._fold_at = keep  # the next fold is tried past this many kept records
        self._asked: tuple[list, list, float] | None = None  # an outstanding ask: servers, calls, when

    def ask(self, servers: list) -> None:
        """Ask every server for its new records without waiting, unless an ask is outstanding."""
        if self._asked is None:
            calls = [s.stats.remote(self._acked.get(s, 0)) for s in servers]
            self._asked = (list(servers), calls, time.monotonic())

    def answered(self, timeout_s: float = POLL_TIMEOUT_S) -> list | None:
        """The outstanding ask's answers, taken, once every server's has arrived; None until then (it
        never waits). An ask a server failed, or one unanswered for `timeout_s` (a dead or stopped
        server: the progress polls find it), is dropped: its records wait in the servers' outboxes."""
        if self._asked is None:
            return None
        servers, calls, asked_at = self._asked
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        if len(ready) < len(calls):
            if time.monotonic() - asked_at >= timeout_s:
                self._asked = None
            return None
        self._asked = None
        try:
            return self._take(servers, ray.get(calls))
        except RayActorError:
            return None

    def poll(self, servers: list, timeout_s: float = POLL_TIMEOUT_S) -> list | None:
        """Take every server's new records; None (nothing taken) when one is dead or slow."""
        try:
            return self.drain(servers, timeout_s)
        except (RayActorError, GetTimeoutError):
            return None

    def drain(self, servers: list, timeout_s: float | None = None) -> list:
        """Take every server's new records; RayActorError when a server is dead."""
        # An outstanding ask is dropped: its records are in these answers too (none is acknowledged).
        self._asked = None
        return self._take(servers, ray.get([s.stats.remote(self._acked.get(s, 0)) for s in servers],
                                           timeout=timeout_s))

    def _take(self, servers: list, answers: list) -> list:
        # Keyed by the handle (Ray's hash it by actor id): a replaced server's new actor counts from 0.
        self._acked = {server: stats.batch for server, stats in zip(servers, answers, strict=True)}
        for server, stats in zip(servers, answers, strict=True):
            self.kept.extend(stats.records)
            if self._last_actor.get(stats.server, server) != server:  # a replacement's first answer
                self._retired[stats.server] += _moved(self.last[stats.server])
            self.last[stats.server], self._last_actor[stats.server] = stats, server
        if len(self.kept) > self._fold_at:
            self._fold()
        if self.on_stats is not None:
            self.on_stats(answers)
        return answers

    def rewind(self, step: int) -> None:
        """Forget the updates of `step` and later (a restore to `step` undid them)."""
        self._asked = None  # its answers may carry undone updates
        self.kept = [r for r in self.kept if r.step < step]
        if step == 0:
            self.folded.clear()
            self.folded_below = 0
        elif step < self.folded_below:  # an older commit than the last one (the newest went missing)
            log.warning("the rollback to step %d undid updates already counted (records below step %d are "
                        "folded): the staleness histogram keeps them", step, self.folded_below)

    def committed(self, step: int) -> None:
        """`step` is committed: no rollback goes below it but to step 0 (it or a newer commit)."""
        self.foldable_below = step
        if len(self.kept) > self.keep:
            self._fold()

    def _fold(self) -> None:
        """Fold the oldest foldable records into counts until `keep` / 2 are kept, as far as they go."""
        older = [r for r in self.kept if r.step < self.foldable_below]
        fold = older[:len(self.kept) - self.keep // 2]
        self.folded.update(r.staleness for r in fold)
        self.folded_below = max([self.folded_below, *(r.step + 1 for r in fold)])
        folded = {id(r) for r in fold}
        self.kept = [r for r in self.kept if id(r) not in folded]
        self._fold_at = max(self.keep, len(self.kept) + self.keep // 2)  # no rescan at every poll

    def bytes_moved(self) -> dict[int, int]:
        """server index -> the bytes pushed to and pulled from it over the job, by every actor it had, as
        their last answers counted them (what a replaced actor moved after its last answer is lost with it)."""
        return {k: self._retired[k] + _moved(stats) for k, stats in sorted(self.last.items())}

    @property
    def updates(self) -> int:
        return len(self.kept) + sum(self.folded.values())

    def staleness_histogram(self) -> dict[int, int]:
        """{staleness: updates} over every update, folded or kept, in increasing staleness."""
        return dict(sorted((self.folded + Counter(r.staleness for r in self.kept)).items()))


def _moved(stats) -> int:
    return stats.bytes_in + stats.bytes_out
