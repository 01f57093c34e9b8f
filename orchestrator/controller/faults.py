"""The controller's own chaos: storage faults on its catalog, corrupt_shard after a commit, kill_controller.

Protocol (the controller owns one `ControllerFaults`, built with the job's armed faults):
  * Storage faults without `rank` (storage_error, storage_latency, torn_write) are installed
    once, at construction, on the catalog's Storage: they hit manifest commits, listings,
    deletes (retention, gc, quarantine) and the controller's manifest reads. `at_seconds` and
    `duration_s` are job seconds on `job_seconds` (the goodput ledger's clock, which a resumed
    job carries over). Storage faults with `rank` are the rank's business (orchestrator.rank.loop).
  * `after_commit(step)` fires each corrupt_shard fault whose `at_step` is reached: the
    first checkpoint committed at or after that step gets one bit of one shard flipped
    (chaos.corrupt). The commit itself stands; the next restore of that step must find the
    damage, quarantine the step and fall back (Controller._restoring).
  * kill_controller (orchestrator.controller.kill): `on_step(step)` for each step the controller
    learns finished, `at_point(point, step)` at its commit points (the Committer calls it just
    before and just after a manifest is created). Unarmed, each is one test of an empty list.
  * Fault notices, from the storage plan (any thread: the reader's fetch pool calls storage
    too) and from corrupt_shard, are queued; `drain()` hands them to the controller's event
    intake on its own thread. Each is marked `handled`: these faults make no rank fail, so a
    later rank failure must never be blamed on them.
  * Fired once per job: `remember(notice)` (the event intake, for each fault notice) writes a
    marker beside the checkpoints for a one-shot fault, as kill_controller does for itself, and
    a later controller of the job (after a kill_controller, or a rerun) counts those fired from
    the start: a kill_rank the rerun passes again does not kill a second time. The markers go
    through a Storage of their own, which the job's storage faults do not touch.
  * `close()` takes the storage faults off the catalog when the job ends.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable

from chaos.config import STORAGE_KINDS, ArmedFault
from chaos.corrupt import corrupt_shard
from chaos.storage_faults import install
from ckpt.storage import AlreadyCommitted, Storage
from orchestrator.controller.kill import MARKER_DIR, ControllerKill, has_fired, marker_name
from orchestrator.wire.messages import FaultFired, decode

log = logging.getLogger(__name__)


class ControllerFaults:
    def __init__(self, faults: list[ArmedFault], catalog, seed: int, job_seconds: Callable[[], float], *,
                 printer=print, kill: ControllerKill | None = None, fired: dict[int, FaultFired] | None = None):
        self.catalog = catalog
        self.fired = {} if fired is None else fired  # the job's fired faults (FaultClock.fired): fired once
        # Built before the storage faults go on the catalog: reading the fired markers is not a fault's target.
        self.kill = kill or ControllerKill(faults, catalog.storage, printer, job_seconds)
        self.markers = Storage(catalog.storage.url, catalog.storage.storage_options)
        # Faults that fire once: not repeating, not kill_controller (its own marker), not a storage
        # fault's window (armed for late joiners and later controllers alike, and noticed at every call).
        self.one_shot = {f.id: f for f in faults if not f.repeat and f.kind != "kill_controller"
                         and not (f.kind in STORAGE_KINDS and f.duration_s)}
        for fault in self.one_shot.values():
            if has_fired(self.markers, fault):
                self.fired.setdefault(fault.id, FaultFired(fault.id, fault.kind, handled=True,
                                                           detail="fired under an earlier controller of this job"))
        self.seed = seed
        self._events: collections.deque[dict] = collections.deque()  # appends and pops are thread-safe
        ours = [f for f in faults if f.kind in STORAGE_KINDS and f.rank is None and f.target != "data"
                and f.id not in self.fired]
        self.on_storage = bool(ours)  # the catalog's storage calls may fail as these faults say
        self._undo = install(catalog.storage, ours, seed=seed, notify=self._on_storage_fault,
                             clock=job_seconds, started=0.0) if ours else None
        self.corruptions = [f for f in faults if f.kind == "corrupt_shard"]

    def _on_storage_fault(self, notice: dict) -> None:
        event = decode(notice)
        event.handled = True
        self._events.append(event)

    def after_commit(self, step: int) -> None:
        """Checkpoint `step` was just committed: fire the corrupt_shard faults it reaches."""
        for fault in self.corruptions:
            if fault.id in self.fired or step < fault.at_step:
                continue
            event = FaultFired(fault.id, "corrupt_shard", time=time.time(), step=step, handled=True)
            try:
                hit = corrupt_shard(self.catalog.storage, step, seed=self.seed)
                event.detail = f"bit {hit.bit} of byte {hit.byte} of {hit.file} ({hit.tensor}) flipped"
            except (OSError, ValueError) as err:  # e.g. a storage fault of the same job hit the rewrite
                event.detail = f"could not be applied: {type(err).__name__}: {err}"
                log.warning("corrupt_shard on step %d %s", step, event.detail)
            self.fired[fault.id] = event  # at once: a second commit in the same drain must not re-fire it
            self._events.append(event)

    def remember(self, notice: FaultFired) -> None:
        """A one-shot fault fired: its marker, so that no later controller of this job arms it again."""
        fault = self.one_shot.get(notice.fault_id)
        if fault is None:
            return
        try:
            self.markers.create_exclusive(self.markers.path(MARKER_DIR, marker_name(fault)),
                                          json.dumps(notice.to_json()).encode())
        except AlreadyCommitted:
            pass  # recorded by an earlier notice of it
        except (OSError, ValueError) as err:
            log.warning("chaos: fault %d fired, but recording it failed (%s: %s): a rerun of the job fires it again",
                        notice.fault_id, type(err).__name__, err)

    def on_step(self, step: int) -> None:
        """The controller learned that `step` finished: fire a due kill_controller."""
        if self.kill.armed:
            self.kill.on_step(step)

    def at_point(self, point: str, step: int) -> None:
        """A controller fault point (chaos.config.CONTROLLER_POINTS) for checkpoint `step`."""
        if self.kill.armed:
            self.kill.at_point(point, step)

    def drain(self) -> list[FaultFired]:
        out = []
        while self._events:
            out.append(self._events.popleft())
        return out

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


def describe_fault(event: FaultFired) -> str:
    """One line for a fault notice: a rank's (kind, rank, step, point), a storage fault's call, a corruption."""
    kind = event.kind
    if kind in STORAGE_KINDS:
        who = f"rank {event.rank}'s" if event.rank is not None else "the controller's"
        return f"{kind} ({event.mode}) on {who} {event.op} of {event.path}"
    if kind == "corrupt_shard":
        return f"corrupt_shard on committed step {event.step}: {event.detail or ''}"
    return f"{kind} on rank {event.rank} at step {event.step} ({event.point})"
