"""The goodput ledger between checkpoints: what lets a successor controller book its predecessor's death.

A checkpoint's manifest carries the ledger as it was at that commit, so a controller that is
killed (its driver process, its node) and run again resumes the totals from there. What
happened after that commit would be in no bucket and not in wall: the steps the dead
controller's job ran past the commit (rolled back now) and the time no controller ran at all.
So the controller also rewrites a small snapshot of its ledger every `SAVE_EVERY_S` seconds
and after every commit (`<job root>/goodput.json`), and a successor resumes from it.

Protocol:
  * the controller calls `maybe_save(ledger)` from its RUNNING loop, `save(ledger)` after a
    commit and `save(ledger, ended=True)` when it stops on its own; a failed write is logged
    and skipped (the snapshot is telemetry: a job never stops for it, and nothing reads it as
    a checkpoint); `background` (the controller's): the writes run on a thread of their own
    (ckpt.housekeeping: a newer snapshot replaces one not yet written), and the ended one is
    waited for, at most `ENDED_WAIT_S`;
  * a successor, on its first restore of committed step R, calls `load()` and
    `resume_totals(at_commit, committed_at, snapshot, started_at)` with the ledger saved with
    R, R's commit time and the wall time it started at, and carries the result into its ledger
    (`carry_from_checkpoint`, which does both). Until then its saves write the predecessor's
    snapshot back as it was (`held`), with the failures of the job's runs
    (orchestrator.controller.failure_carry): a run that ends before it carried holds only its own
    seconds, and the next run must still find the job's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from ckpt.housekeeping import Housekeeper
from monitor.goodput import BUCKETS, PRODUCTIVE

SNAPSHOT_FILE = "goodput.json"
SAVE_EVERY_S = 5.0
DOWN_BUCKET = "other"  # no controller ran: the time is no other bucket's
ENDED_WAIT_S = 10.0  # the run's last snapshot: a successor needs `ended`, but a hung store must not hold the exit

log = logging.getLogger(__name__)


def resume_totals(at_commit: dict[str, float], committed_at: float, snapshot: dict | None,
                  started_at: float) -> dict[str, float]:
    """The totals a successor controller resumes with.

    `at_commit`: the ledger saved with the checkpoint it restores, committed at wall time
    `committed_at`. `snapshot`: the newest one (`{"time": epoch seconds, "totals": {...},
    "ended": bool}`) or None. The newer of the two (in job seconds) is resumed: from a
    snapshot, the productive time it holds beyond the commit moves to lost_work (those steps
    are rolled back). The wall time from the resumed one to `started_at` (when this controller
    began) goes to `other`: no controller was running, or one was about to die (up to
    `SAVE_EVERY_S` of it). Unless the predecessor ended on its own (`ended`, a job that
    failed and was run again later): the wait before a deliberate rerun is the operator's,
    not the job's.
    """
    snapshot = _newest(at_commit, committed_at, snapshot)
    totals = dict(snapshot["totals"])
    lost = max(0.0, totals.get(PRODUCTIVE, 0.0) - at_commit.get(PRODUCTIVE, 0.0))
    totals[PRODUCTIVE] = totals.get(PRODUCTIVE, 0.0) - lost
    totals["lost_work"] = totals.get("lost_work", 0.0) + lost
    if not snapshot.get("ended"):
        totals[DOWN_BUCKET] = totals.get(DOWN_BUCKET, 0.0) + max(0.0, started_at - float(snapshot["time"]))
    return totals


def saved_goodput(ledger, record, step: int) -> dict[str, float]:
    """The ledger as the checkpoint of completed step `step` saves it, at its commit: the steps the
    job finished past `step` while the save was written in the background are in lost_work, not
    productive, since a successor that restores this checkpoint redoes them (`resume_totals` books
    only what productive holds beyond the commit's ledger as lost)."""
    totals = ledger.to_dict()
    past = min(record.work_seconds(step, record.last_step + 1), totals[PRODUCTIVE])
    totals[PRODUCTIVE] -= past
    totals["lost_work"] = totals.get("lost_work", 0.0) + past
    return totals


def ledger_source(step: int, manifest) -> tuple[int, float]:
    """(`step`, the productive seconds its manifest's ledger holds): where a resumed job's ledger came from."""
    return step, float(manifest.state.get("goodput", {}).get(PRODUCTIVE, 0.0))


def book_older_restore(ledger, carried: tuple[int, float] | None, step: int | None, read_manifest) -> str:
    """A resumed job's first restore landed at `step` (None: a fresh start), and its ledger was carried from
    `carried` (ledger_source's): landing older (that checkpoint proved corrupt, or unreadable, and an older
    one loaded), the work the job did between the two is redone, so it moves from productive to lost_work
    (the two manifests' productive seconds apart). The words for the restore's line ("" for none). Collective
    jobs (LedgerCarry.on_restored) and parameter-server jobs (orchestrator.cli.ps_run) alike."""
    if carried is None or (step or 0) >= carried[0]:
        return ""
    try:
        older = 0.0 if step is None else ledger_source(step, read_manifest(step))[1]
    except Exception as err:  # noqa: BLE001 (telemetry: the restore that read it succeeded; book nothing)
        log.warning("the work redone after step %d is not booked: step %s's manifest did not read (%s)",
                    carried[0], step, err)
        return ""
    more = ledger.move(max(0.0, carried[1] - older), PRODUCTIVE, "lost_work")
    return f"; older than step {carried[0]}, whose ledger was carried: {more:.2f} s of the job's work to redo"


def _known(totals: dict[str, float]) -> dict[str, float]:
    """`totals` less the buckets this release does not know (a newer writer's)."""
    return {bucket: seconds for bucket, seconds in totals.items() if bucket in BUCKETS}


def _newest(at_commit: dict[str, float], committed_at: float, snapshot: dict | None) -> dict:
    """The newer record of the job's time (in job seconds): the snapshot, or the commit's ledger."""
    if snapshot is None or sum(snapshot["totals"].values()) < sum(at_commit.values()):
        return {"time": committed_at, "totals": at_commit, "ended": False}
    return snapshot


def carry_from_checkpoint(manifest, ledger, history: list, snapshots: LedgerSnapshots | None,
                          started_at: float, snapshot: dict | None = None) -> float | None:
    """A restarted controller's first restore: carry into `ledger` the goodput saved with the
    restored checkpoint's `manifest` (resumed by `resume_totals` against the newest snapshot) and
    put the step history it saved (which steps the restored model holds) in front of `history`.

    Returns the carried job seconds (the resumed job's clock), or None when the checkpoint has no
    ledger. Buckets this release does not know are dropped, as a newer writer's would be. A
    snapshot that cannot be read is ignored (LedgerSnapshots.load), so this never fails a restore.
    `snapshots` None: no snapshot to resume against; `snapshot`: the newest one, read already (else
    read now)."""
    state = manifest.state
    history[:0] = state.get("history", [])
    saved = state.get("goodput")
    if not saved:
        return None
    newest = _newest(saved, manifest.created_at, snapshot or (snapshots.load() if snapshots else None))
    carried = _known(resume_totals(saved, manifest.created_at, newest, started_at))
    # The predecessors' own booking is the base of this driver's badput counters: the reckoning above
    # (their rolled-back steps, the time no driver ran) is badput this driver books.
    ledger.carry(carried, prior=_known(newest["totals"]))
    return sum(carried.values())


class LedgerSnapshots:
    """`owner`: the driver's lease on the root (ckpt.ownership); once it is lost, nothing is saved
    (the snapshot belongs to the driver that claimed the root since)."""

    def __init__(self, storage, every_s: float = SAVE_EVERY_S, clock=time.monotonic, owner=None,
                 background: bool = False):
        self.storage = storage
        self.housekeeper = Housekeeper("undying-goodput-snapshot") if background else None
        self.owner = owner
        self.every_s = every_s
        self.clock = clock
        self.path = storage.path(SNAPSHOT_FILE)
        self._last = -float("inf")
        self._warned = False
        # The failures a rerun's restart budget counts (orchestrator.controller.failure_carry sets it).
        self.failures: Callable[[], list[dict]] = list
        # The predecessor's snapshot, written back as it is (with this run's failures) until this run
        # has carried it (LedgerCarry.finish): a run that ends before its first restore (a placement
        # error, a signal while placing) holds only its own seconds, which must not replace the job's.
        self.held: dict | None = None

    @classmethod
    def beside(cls, storage, owner=None) -> LedgerSnapshots:
        """The controller's: written in the background, through a Storage of its own on the same root,
        not the catalog's, which carries the chaos storage faults aimed at the checkpoints (a write
        fault must fail a checkpoint write, not be spent on this telemetry)."""
        from ckpt.storage import Storage

        return cls(Storage(storage.url, storage.storage_options), owner=owner, background=True)

    def maybe_save(self, ledger) -> None:
        """`save`, if the last one is `every_s` old."""
        if self.clock() - self._last >= self.every_s:
            self.save(ledger)

    def save(self, ledger, ended: bool = False, within_s: float = ENDED_WAIT_S) -> None:
        """Write the ledger's totals now; `ended` when the controller stops on its own (run's end), waiting
        for the write at most `within_s` (what a preemption's grace left)."""
        self._last = self.clock()
        if self._fenced():
            return
        own = {"time": time.time(), "totals": ledger.totals(), "ended": ended}
        kept = {key: self.held[key] for key in ("time", "totals", "ended")} if self.held else own
        data = json.dumps({**kept, "failures": self.failures()}).encode()
        if self.housekeeper is None:
            return self._write(data)
        self.housekeeper.submit(lambda: self._write(data))
        wait_s = min(ENDED_WAIT_S, within_s)
        if ended and not self.housekeeper.close(wait_s):
            log.warning("the last goodput snapshot was not written within %g s (a slow store)", wait_s)

    def _fenced(self) -> bool:
        """Another driver took the root, or this one released it (the run's end gave up waiting for the
        last write on a slow store, and the next claimant takes the root at once)."""
        return self.owner is not None and (self.owner.lost is not None or self.owner.released)

    def _write(self, data: bytes) -> None:
        if self._fenced():
            return  # lost or released while this write waited its turn: the snapshot is the next owner's now
        try:
            with self.storage.atomic_writer(self.path) as handle:
                handle.write(data)
        except Exception as err:  # telemetry: logged once, never fatal
            if not self._warned:
                log.warning("could not save the goodput snapshot %s (%s); a successor controller will not "
                            "book the time after the last commit", self.path, err)
                self._warned = True

    def load(self) -> dict | None:
        """The newest snapshot, or None when there is none, it does not parse or cannot be read (a
        storage error here must not fail the restore that asks: the commit's own ledger then resumes)."""
        try:
            data = json.loads(self.storage.read(self.path))
            totals = {k: float(v) for k, v in data["totals"].items() if k in BUCKETS}
            if any(v < 0 for v in totals.values()):
                raise ValueError(f"negative seconds in {totals}")
            return {"time": float(data["time"]), "totals": totals, "ended": bool(data.get("ended", False)),
                    "failures": data.get("failures", [])}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("ignoring the goodput snapshot %s: %s", self.path, err)
            return None


class LedgerCarry:
    """Carries the goodput ledger and step history saved with a checkpoint into this controller, on
    the first restore of this invocation only (`carry(step)`, from RESTORING): later restores load
    checkpoints this invocation wrote itself, whose ledger is already in ours. `done` is also set
    by a first generation that restores nothing (building its engine is start-up work): `finish()`."""

    def __init__(self, read_manifest, ledger, record, snapshots: LedgerSnapshots, started_at: float, fault_clock):
        self.read_manifest, self.ledger, self.record = read_manifest, ledger, record
        self.snapshots, self.started_at, self.fault_clock = snapshots, started_at, fault_clock
        self.done = False
        self.carried_from: tuple[int, float] | None = None  # (step carried from, its manifest's productive seconds)

    def carry(self, step: int) -> None:
        """A torn manifest raises CorruptCheckpoint (the caller handles it as for the restore itself)."""
        if self.done:
            return
        manifest = self.read_manifest(step)  # retried while the store fails transiently
        held = self.snapshots.held if self.snapshots is not None else None  # read at the start: not again
        self.finish()  # from here on, a retry must not carry (or prepend the history) again
        carried = carry_from_checkpoint(manifest, self.ledger, self.record.history, self.snapshots, self.started_at,
                                        held)
        if carried is not None:
            self.carried_from = ledger_source(step, manifest)
            self.record.carry_clock(carried)  # the report's times count on from the resumed job's
            self.fault_clock.skip_before(carried)
            self.ledger.enter("checkpoint_restore")

    def on_restored(self, step: int | None) -> str:
        """The first restore landed at `step` (None: a fresh start): older than the checkpoint carried from
        (that one proved corrupt, or unreadable, and an older one loaded), the work the job did between the
        two is redone, so it moves from productive to lost_work (the two manifests' productive seconds
        apart). Returns the words for the transition's sentence."""
        carried, self.carried_from = self.carried_from, None
        return book_older_restore(self.ledger, carried, step, self.read_manifest)

    def start_fresh(self, asked: bool = False) -> None:
        """The first restore finds nothing to restore (a fresh start). A predecessor that died before its
        first commit (its controller killed: its snapshot not `ended`) left its snapshot: its seconds are
        the job's, its productive ones all lost work (nothing it trained survives) and the time no driver
        ran `other`, and the report's clock, and with it the timed faults already due, go on from them.
        Not a run that ended on its own (a failed job run again starts over), nor one `asked` to start
        fresh (`undying run --fresh`)."""
        if self.done:
            return
        held = self.snapshots.held if self.snapshots is not None else None
        self.finish()
        if held is None or held.get("ended") or asked:
            return
        carried = _known(resume_totals({}, 0.0, held, self.started_at))
        self.ledger.carry(carried, prior=_known(held["totals"]))
        self.record.carry_clock(sum(carried.values()))
        self.fault_clock.skip_before(sum(carried.values()))

    def finish(self) -> None:
        """Carried, or nothing to carry: the snapshots hold this run's ledger, the job's from here on."""
        self.done = True
        if self.snapshots is not None:
            self.snapshots.held = None
