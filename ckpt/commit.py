"""Controller side of a save: collect shard receipts, commit the manifest, apply retention.

Protocol: the controller feeds every `receipt` event of the current generation to
`on_receipt`; when the receipts of all `world_size` ranks for a step are in, the manifest
is committed (ckpt.catalog) and the step becomes the newest restore point. Receipts of an
older generation never arrive here (the generation's store prefix is dropped). A pending
step that a newer commit overtook can never complete usefully and is dropped. A step whose
shards do not tile every logical tensor exactly (ckpt.manifest.merge_receipts) is refused,
logged as an error and kept in `rejected`: such a state must never become a checkpoint.

A save that cannot commit never stops the job (the next save will commit; chaos faults
exercise each case): a rank's failed shard write (`abandon`, from its `save_error` event:
the step's later receipts are ignored), and a manifest create that fails, retried once
(ckpt.manifest_create: a lost reply settled, a torn manifest moved aside).
Every save that will not commit is passed to
`on_dropped(step, reason)` (the controller logs and counts it).
Retention and garbage collection after a commit are best effort: a storage error there is
logged and they run again at the next commit. Given a `housekeeper` (the controller's), they run
on its thread (ckpt.housekeeping): the controller's loop never waits on their listings and
deletes, a newer commit's pass replaces one not yet started, `stop_retention` (at a restore and
at `reset`) drops a queued pass and stops a running one at its next deletion
(ckpt.housekeeping.PassFence), and `settle(timeout_s)` waits for it to stop. GC never takes the
step of a create that failed twice with the store's errors (`unsure`: a stalled request of it may
still land and name its shards).

The manifest create itself may run off the controller's thread too (given a `lane`: the
controller's, unless chaos faults act on the controller): on a throttling or hung store the
create, its retry and the read that settles a lost reply take one to several client timeouts, and
a controller waiting on them notices no dead rank, hang or signal meanwhile. A complete save is
then handed to the lane (`committing`, in `unsettled` with the saves still collecting receipts)
and `on_receipt` returns None; the lane runs the store's part of the commit (`_attempt`, which
changes none of the committer's state), and the controller's thread settles what it came to at
its next `collect(book)`: in step order, each Commit booked through `book` as it is settled (a
failed save after it counts from it), the callbacks (`on_dropped`, `on_skipped`), and the errors
(a lost owner lease, a bug) raised there as an inline commit raises them (a run of failed saves
that a newer commit of the batch ended raises nothing). A complete save handed over while an
older one's create is still queued replaces it (the lane runs the newest: its commit makes the
older one's moot, and a slow store builds no queue); the older one is reported skipped then, and
so is a complete save older than a create under way: failed (`on_dropped`) instead when that
create is `overdue()`, unanswered past `create_limit_s` (checkpoint.commit_timeout_s).
`flush(timeout_s)` waits for the create under way: the controller calls it before a recovery or
a restore chooses its step (no commit lands behind their back) and after a grow stops its
generation; a stop or the job's end waits while `committing` holds a save.

Chaos: `fault_point(point, step)` is called just before the manifest create
("before_manifest_commit": every shard is durable, nothing is committed) and just after it
succeeded ("after_manifest_commit": committed, before retention and before the controller
learns of it); the controller passes its ControllerFaults.at_point (kill_controller).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckpt.catalog import Catalog
from ckpt.errors import IncompleteCheckpoint
from ckpt.failed_saves import SavesFailing
from ckpt.housekeeping import Housekeeper, PassFence, Superseded
from ckpt.manifest import ShardReceipt
from ckpt.manifest_create import Attempt, PendingSave, create_manifest
from ckpt.ownership import OwnershipLost
from ckpt.storage_errors import storage_failure

__all__ = ["Commit", "Committer"]
log = logging.getLogger(__name__)


@dataclass
class Commit:
    step: int
    nbytes: int
    blocking_s: float  # worst rank's blocking time: what the save cost training
    total_s: float  # first rank starting to stage -> durable manifest
    committed_at: float
    samples: dict[int, list[int]] = field(default_factory=dict)  # rank -> [first, end, count, digest]


class Committer:
    def __init__(self, catalog: Catalog, job: str, spec_hash: str, keep: int,
                 on_dropped: Callable[[int, str], None] = lambda step, reason: None,
                 fault_point: Callable[[str, int], None] | None = None, files_here: bool = True,
                 housekeeper: Housekeeper | None = None, lane: Housekeeper | None = None,
                 create_limit_s: float = math.inf):
        self.catalog = catalog
        self.create_limit_s = create_limit_s  # checkpoint.commit_timeout_s: a create unanswered past it (`overdue`)
        self._creating: tuple[int, float] | None = None  # (step, monotonic start) of the lane's create under way
        self.housekeeper = housekeeper  # None: retention and GC run inline, at the commit
        self.lane = lane  # None: manifest creates run inline, in `on_receipt`
        self.committing: dict[int, PendingSave] = {}  # complete saves handed to the lane, not yet settled
        self._attempts: list[Attempt] = []  # what the lane finished, for `collect` (under `_attempts_lock`)
        self._attempts_lock = threading.Lock()
        self._queued: int | None = None  # the step of the create submitted last (replaced if not begun)
        self.generations = 0  # `stop_retention`s so far: a background pass stops once it moved (PassFence)
        self.files_here, self.fault_point, self.on_dropped = files_here, fault_point, on_dropped  # (see Catalog.commit)
        self.job, self.spec_hash, self.keep = job, spec_hash, keep
        self.pending: dict[int, PendingSave] = {}
        self.latest: int | None = None
        self.rejected: dict[int, str] = {}  # step -> why its shards could not be committed
        # Steps of this generation whose save is settled uncommitted: a rank failed to write its shard,
        # or the save was dropped or skipped; a late shard error of one is that same save, not another.
        self.abandoned: set[int] = set()
        # Committed steps this run skipped at its restores (unreadable then, not proven bad): retention
        # neither counts nor deletes them, and a save reaching one of their step numbers finds it
        # committed by the history the job left; that step is kept as it is, the save skipped, not failed.
        self.left_behind: set[int] = set()
        # Steps whose creates failed with the store's errors (timeouts): a request the store stalled may
        # still land and name their shards, so this run's GC never takes their directories for orphans.
        self.unsure: set[int] = set()
        self.on_skipped: Callable[[int, str], None] = lambda step, reason: log.warning(
            "checkpoint step %d not committed: %s", step, reason)

    def reset(self, latest: int | None, left_behind: Iterable[int] = ()) -> None:
        """Start of a generation: nothing is pending; `latest` is the restore point; `left_behind`:
        the committed steps this run's restores skipped."""
        self.pending.clear()
        self.stop_retention()  # its GC could take this generation's saves below `latest` for orphans
        self.abandoned.clear()  # a new generation may save those steps again
        self.latest = latest
        self.left_behind = set(left_behind)

    def stop_retention(self) -> None:
        """Stop the running retention pass at its next deletion, drop a queued one: at each `reset`, and
        as a restore chooses its step (a pass planned before could delete the commit it falls back to)."""
        self.generations += 1
        if self.housekeeper is not None:
            self.housekeeper.discard()

    def abandon(self, step: int, reason: str) -> None:
        """A rank could not write its shard of `step`: the save cannot commit; drop it now,
        so it does not sit pending (CHECKPOINTING) until a later commit overtakes it. A second
        rank failing the same save drops nothing more: it is one failed save."""
        if step in self.abandoned or step in self.committing or (self.latest is not None and step <= self.latest):
            return  # a late error (its receipt's push failed after it was queued) of a complete save
        self.abandoned.add(step)
        self.pending.pop(step, None)
        self.on_dropped(step, reason)

    def on_receipt(self, receipt: ShardReceipt, extra: dict, world_size: int, generation: int, layout: dict,
                   extra_state: Callable[[dict], dict]) -> Commit | None:
        """One rank's receipt (with rank 0's `extra`: {"engine": state metadata}; with the first rank of
        each dp replica's: {"samples": its sample digest}); the Commit when it completed a save, else
        None. `extra_state(samples)` (rank -> digest) gives what the manifest carries beyond the shards."""
        if receipt.step in self.abandoned:
            return None
        began = time.time() - receipt.write_s - receipt.blocking_s
        save = self.pending.setdefault(receipt.step, PendingSave(receipt.step, began))
        save.started_at = min(save.started_at, began)
        save.receipts[receipt.rank] = receipt
        if "engine" in extra:
            save.engine_state = extra["engine"]
        if "samples" in extra:
            save.samples[receipt.rank] = list(extra["samples"])
        if len(save.receipts) < world_size or save.engine_state is None:
            return None
        del self.pending[receipt.step]
        if self._overtaken(receipt.step):
            return None
        attempt = Attempt(save, kept=save.step in self.left_behind)
        state = extra_state(save.samples)  # on this thread: it reads the controller's state
        if self.lane is None:
            return self._settle(self._attempt(attempt, generation, layout, state))
        self.committing[save.step] = save

        def create() -> None:
            with self._attempts_lock:
                self._creating = (save.step, time.monotonic())
            try:
                self._attempt(attempt, generation, layout, state)
            finally:
                with self._attempts_lock:
                    self._attempts.append(attempt)
                    self._creating = None

        previous, self._queued = self._queued, save.step
        if self.lane.submit(create) is not None:  # the create submitted before this one had not begun: moot now
            self.committing.pop(previous, None)
            self.abandoned.add(previous)
            self._not_committed(previous, f"the newer save of step {save.step} was complete before its manifest "
                                          "create began")
        return None

    def overdue(self) -> str | None:
        """Why the lane's create under way counts as failed (unanswered past `create_limit_s`), or None."""
        with self._attempts_lock:
            creating = self._creating
        waited = time.monotonic() - creating[1] if creating is not None else 0.0
        if creating is None or waited <= self.create_limit_s:
            return None
        return (f"the manifest create of step {creating[0]} has not returned for {waited:.0f} s "
                f"(checkpoint.commit_timeout_s={self.create_limit_s:g}): the store is not taking writes")

    def _not_committed(self, step: int, reason: str) -> None:
        """A complete save that will not commit because of a create under way or queued before it: skipped
        (the newer one's commit makes it moot), or failed when that create is overdue (nothing may commit)."""
        overdue = self.overdue()
        if overdue is None:
            self.on_skipped(step, reason)
        else:
            self.on_dropped(step, f"{reason}; {overdue}")

    @property
    def unsettled(self) -> dict[int, PendingSave]:
        """The saves not yet committed nor dropped: collecting receipts, or their manifest being created."""
        return {**self.pending, **self.committing}

    def collect(self, book: Callable[[Commit], Any] = lambda commit: commit) -> list:
        """Controller thread: settle what the lane's creates came to since the last call, oldest first, each
        Commit booked (`book`) as it is settled, so that a failed save after it counts from it; what `book`
        returned, in order. Every attempt is settled before the first error among them is raised, except a
        run of failed saves (SavesFailing, from `on_dropped`) that a newer commit of the batch ended."""
        with self._attempts_lock:
            attempts, self._attempts = self._attempts, []
        booked, errors, newest = [], [], -1
        for attempt in attempts:
            self.committing.pop(attempt.save.step, None)
            try:
                commit = self._settle(attempt)
                if commit is not None:
                    newest = commit.step  # durable already: it ends the run of failures before it
                    booked.append(book(commit))
            except Exception as err:  # noqa: BLE001 (raised below, once the others are settled)
                errors.append((attempt.save.step, err))
        errors = [err for step, err in errors if not (isinstance(err, SavesFailing) and step < newest)]
        if errors:
            raise errors[0]
        return booked

    def flush(self, timeout_s: float) -> bool:
        """Wait for the lane's create under way, if any (at most `timeout_s`); whether none is. The
        caller then `collect`s."""
        return self.lane is None or self.lane.settle(timeout_s)

    def _overtaken(self, step: int) -> bool:
        """Whether complete save `step` is older than the newest commit, or than a create under way."""
        if self.latest is not None and step <= self.latest:
            return True
        newer = [s for s in self.committing if s > step]
        if newer:
            self.abandoned.add(step)
            self._not_committed(step, f"complete after the newer save of step {max(newer)}, whose manifest is being "
                                      "created")
        return bool(newer)

    def _attempt(self, attempt: Attempt, generation: int, layout: dict, extra: dict) -> Attempt:
        """The store's part of a commit (fault points, the create, its retry, the landed read), on
        whichever thread runs it: it changes none of the committer's state, `_settle` does."""
        step = attempt.save.step
        try:
            if self.fault_point is not None:
                self.fault_point("before_manifest_commit", step)
            attempt.manifest = create_manifest(self.catalog, attempt, job=self.job, spec_hash=self.spec_hash,
                                               generation=generation, layout=layout, extra=extra,
                                               files_here=self.files_here)
            attempt.committed_at = time.time()
            if attempt.manifest is not None and self.fault_point is not None:
                self.fault_point("after_manifest_commit", step)
        except IncompleteCheckpoint as err:
            log.error("checkpoint step %d NOT committed: the shards of the %d ranks do not form a complete "
                      "checkpoint: %s", step, len(attempt.save.receipts), err)
            attempt.rejected, attempt.failed = str(err), f"its shards do not form a complete checkpoint: {err}"
        except Exception as err:  # noqa: BLE001 (raised again by `_settle`, on the controller's thread)
            attempt.error = err
        return attempt

    def _settle(self, attempt: Attempt) -> Commit | None:
        """Controller thread: what `attempt` came to, acted on; the Commit when it committed."""
        step = attempt.save.step
        if attempt.error is not None:
            raise attempt.error
        if attempt.manifest is not None:
            return self._committed(attempt)
        self.abandoned.add(step)
        if attempt.skipped is not None:
            self.on_skipped(step, attempt.skipped)
        else:
            self.rejected[step] = attempt.rejected
            if attempt.unsure:
                self.unsure.add(step)
            self.on_dropped(step, attempt.failed)
        return None

    def _committed(self, attempt: Attempt) -> Commit:
        """Controller thread: the manifest of `attempt` is durable: it is the newest restore point."""
        save = attempt.save
        self.latest = save.step
        self.left_behind.discard(save.step)  # a quarantined step saved and committed again is this run's own
        for step in [s for s in self.pending if s < save.step]:
            log.info("dropping incomplete save of step %d, overtaken by step %d", step, save.step)
            del self.pending[step]
        self._tidy(save.step)
        return Commit(step=save.step, nbytes=attempt.manifest.total_bytes,
                      blocking_s=max(r.blocking_s for r in save.receipts.values()),
                      total_s=attempt.committed_at - save.started_at,
                      committed_at=attempt.committed_at, samples=save.samples)

    def _tidy(self, step: int) -> None:
        """Retention and GC after the commit of `step`, inline or on the housekeeper's thread, with the
        committer's state as it is now (the controller's thread changes it while the pass runs)."""
        keep, newest, left_behind = self.keep, self.latest, set(self.left_behind)
        in_flight = set(self.unsettled) | self.unsure  # (unsure: see __init__)
        catalog, began = self.catalog, self.generations
        if self.housekeeper is not None:
            catalog = Catalog(catalog.storage, PassFence(catalog.owner, lambda: self.generations == began))

        def tidy() -> None:
            try:
                catalog.apply_retention(keep, newest=newest, left_behind=left_behind)
                catalog.collect_garbage(in_flight=in_flight, before=newest)
            except Superseded as err:
                log.info("checkpoint retention after step %d stopped: %s", step, err)
            except OwnershipLost as err:
                if self.housekeeper is None:
                    raise  # the controller's thread: it ends the job (the controller sees the lease lost too)
                log.warning("checkpoint retention after step %d stopped: %s", step, err)
            except Exception as err:
                if not storage_failure(err):
                    raise
                log.warning("checkpoint retention after step %d failed (%s: %s); it runs again at the next commit",
                            step, type(err).__name__, err)

        if self.housekeeper is None:
            tidy()
        else:
            self.housekeeper.submit(tidy)

    def settle(self, timeout_s: float) -> bool:
        """Wait for a retention pass still running (at most `timeout_s`); whether none is."""
        return self.housekeeper is None or self.housekeeper.settle(timeout_s)
