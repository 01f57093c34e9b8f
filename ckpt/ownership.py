"""Who may change a checkpoint root: an owner lease, so that two controllers never run one job.

Two drivers of one job (a resubmission while the first still runs, two operators, a driver cut
off from the store and replaced) would both commit, retire and collect garbage in one folder.
Neither can damage a committed checkpoint (manifests are created exclusively), but each takes
the other's saves in flight for garbage, and their steps interleave. The lease makes one of
them the owner and stops the other.

Files under `<root>/owner/`: `claim-<epoch>.json`, created exclusively
(Storage.create_exclusive) and never rewritten: who holds that epoch (holder, process identity,
lease seconds, wall time); `beat-<epoch>.json`, rewritten by the holder every lease / 6:
{"beat": n, "time": wall, "ended": bool}. The newest claim is the owner.

Protocol. The driver calls `OwnerLease.claim(storage, holder, lease_s)` before anything writes
to the root; the catalog calls `lease.check()` before every change it makes (ckpt.catalog:
a commit, retention, garbage collection, a quarantine); the controller reads `lease.lost` at
each poll (a reason once a newer claim was seen: the job ends); the driver calls
`lease.release()` when the job ends, however it ends. Tools that delete (`undying ckpt gc`,
`undying chaos --fresh`) ask `live_owner(storage)` first.

Claiming judges the newest claim (`judge`): none, released (its beat says ended), its process
certainly gone (same host: ckpt.process_identity), or its last beat older than STALE_LEASES
leases by the wall clock: claim at once. Otherwise its beat is watched for one of its leases on
our monotonic clock, so no two hosts' clocks are compared: a beat that advances is a live
owner (OwnerAlive, naming it; nothing was written), a silent one a dead owner. Claiming creates
claim-<newest + 1>; a claimant that loses that race to another judges again.

Fencing: a holder that sees a newer claim (its heartbeat lists the claims at each beat, and
`check` lists them again) was judged dead while its store was unreachable for a lease, and
changes nothing more. What remains is a change made between a `check` and another's claim:
that needs our beats to fail for a whole lease while our commit path still reaches the store.
A failed beat is logged and ends nothing: a store outage is not a takeover, which needs a claim
in the store that the next check would see.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ckpt import process_identity
from ckpt.storage import AlreadyCommitted, Storage

log = logging.getLogger(__name__)

OWNER_DIR = "owner"
BEATS_PER_LEASE = 6
STALE_LEASES = 10  # a beat this many leases old (wall clocks) is dead even across skewed clocks
KEEP_CLAIMS = 8  # older claims are deleted at release: the recent owners stay as a record


class OwnerAlive(RuntimeError):
    """The root is owned by a job whose heartbeat advanced while we watched: nothing was claimed."""


class OwnershipLost(RuntimeError):
    """A newer claim took the root: this holder must change nothing more."""


@dataclass
class Claim:
    epoch: int
    record: dict  # holder, process, lease_s, claimed_at
    beat: dict | None  # the holder's newest beat; None before its first

    def describe(self) -> str:
        process = self.record.get("process", {})
        host = str(process.get("host", "?")).split("/")[0]
        return f"{self.record.get('holder', '?')} on host {host}, pid {process.get('pid', '?')}"

    def last_seen(self) -> float:
        return float((self.beat or {}).get("time", self.record.get("claimed_at", 0.0)))


def _name(kind: str, epoch: int) -> str:
    return f"{kind}-{epoch:010d}.json"


def epochs(storage: Storage) -> list[int]:
    """The epochs claimed under `storage`'s root, oldest first."""
    found = []
    for name in storage.listdir(storage.path(OWNER_DIR)):
        stem = name.removeprefix("claim-").removesuffix(".json")
        if name.startswith("claim-") and name.endswith(".json") and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def read_claim(storage: Storage, epoch: int) -> Claim:
    record = json.loads(storage.read(storage.path(OWNER_DIR, _name("claim", epoch))))
    try:
        beat = json.loads(storage.read(storage.path(OWNER_DIR, _name("beat", epoch))))
    except FileNotFoundError:
        beat = None
    return Claim(epoch, record, beat)


def newest_claim(storage: Storage) -> Claim | None:
    found = epochs(storage)
    return read_claim(storage, found[-1]) if found else None


def standing(claim: Claim, now: float, gone: Callable[[dict], bool] = process_identity.gone) -> str:
    """"released", "gone" (its process certainly ended), "stale" (its last beat STALE_LEASES leases
    old by the wall clock) or "running" (not known to have stopped: its beat must be watched)."""
    if (claim.beat or {}).get("ended"):
        return "released"
    if gone(claim.record.get("process", {})):
        return "gone"
    if now - claim.last_seen() > STALE_LEASES * float(claim.record.get("lease_s", 0.0)):
        return "stale"
    return "running"


def judge(claim: Claim | None, now: float, gone: Callable[[dict], bool] = process_identity.gone) -> str | None:
    """Why `claim` may be taken at once, or None when its beat must be watched first."""
    if claim is None:
        return "no owner"
    state = standing(claim, now, gone)
    return {"released": f"its last owner ({claim.describe()}) released it",
            "gone": f"its last owner ({claim.describe()}) is no longer running",
            "stale": f"its last owner ({claim.describe()}) was last seen {now - claim.last_seen():.0f} s ago",
            }.get(state)


def owner_status(storage: Storage) -> dict | None:
    """The newest claim on `storage`'s root as plain data (`undying ckpt ls`), None when never claimed:
    holder, host, pid, epoch, seconds since its last beat and its `standing`."""
    claim = newest_claim(storage)
    if claim is None:
        return None
    process, now = claim.record.get("process", {}), time.time()
    return {"holder": claim.record.get("holder"), "host": str(process.get("host", "")).split("/")[0],
            "pid": process.get("pid"), "epoch": claim.epoch, "last_beat_age_s": round(now - claim.last_seen(), 3),
            "standing": standing(claim, now)}


def live_owner(storage: Storage) -> str | None:
    """Who owns `storage`'s root now, for a tool about to delete in it; None when nobody may.
    Judges without watching: an owner not known to be gone or stale counts as live."""
    claim = newest_claim(storage)
    if claim is None or judge(claim, time.time()) is not None:
        return None
    return f"{claim.describe()} (last heartbeat {time.time() - claim.last_seen():.0f} s ago)"


class OwnerLease:
    """This process's claim on a checkpoint root, kept alive by a heartbeat thread."""

    def __init__(self, storage: Storage, epoch: int, holder: str, lease_s: float):
        self.storage, self.epoch, self.holder, self.lease_s = storage, epoch, holder, lease_s
        self.lost: str | None = None
        self.token = uuid.uuid4().hex  # tells our claim from one of the same epoch made after a wipe
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="undying-owner-lease", daemon=True)

    @classmethod
    def claim(cls, storage: Storage, holder: str, lease_s: float,
              say: Callable[[str], None] = lambda line: None) -> OwnerLease:
        """Own `storage`'s root (module doc), or raise OwnerAlive; `say` hears why a claim waits."""
        for _ in range(5):  # each turn loses a race to another claimant, or watches a dead owner
            claim = newest_claim(storage)
            reason = judge(claim, time.time())
            if reason is None:
                say(f"the checkpoint root is claimed by {claim.describe()}; watching its heartbeat for up to "
                    f"{float(claim.record['lease_s']):.0f} s to tell whether it still runs")
                reason = _watch(storage, claim)
            lease = cls(storage, (claim.epoch + 1) if claim else 0, holder, lease_s)
            if lease._create(reason):
                return lease
        raise OwnerAlive(f"the checkpoint root {storage.root} keeps being claimed by others; try again")

    def _create(self, reason: str) -> bool:
        record = {"holder": self.holder, "process": process_identity.this_process(), "lease_s": self.lease_s,
                  "claimed_at": time.time(), "taken_because": reason, "token": self.token}
        try:
            self.storage.create_exclusive(self.storage.path(OWNER_DIR, _name("claim", self.epoch)),
                                          json.dumps(record).encode())
        except AlreadyCommitted:
            return False
        self._beat()
        self._thread.start()
        log.info("owner of %s (epoch %d): %s", self.storage.root, self.epoch, reason)
        return True

    def check(self) -> None:
        """Raise OwnershipLost unless this holder still owns the root (lists the claims now)."""
        if self.lost is None:
            self._look_for_newer()
        if self.lost is not None:
            raise OwnershipLost(self.lost)

    def release(self) -> None:
        """Stop the heartbeat and mark the claim ended, so the next claimant need not wait; prune old claims."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.lost is not None:
            return
        try:
            self._beat(ended=True)
            for epoch in epochs(self.storage)[:-KEEP_CLAIMS]:
                for kind in ("beat", "claim"):
                    self.storage.remove(self.storage.path(OWNER_DIR, _name(kind, epoch)))
        except Exception as err:  # the store; the claim then expires on its own
            log.warning("could not release the owner lease of %s (%s: %s); the next run waits for it to expire",
                        self.storage.root, type(err).__name__, err)

    def _beat(self, ended: bool = False) -> None:
        self._beats += 1
        beat = {"beat": self._beats, "time": time.time(), "ended": ended}
        self.storage.write_immutable(self.storage.path(OWNER_DIR, _name("beat", self.epoch)), json.dumps(beat).encode())

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / BEATS_PER_LEASE):
            try:
                self._look_for_newer()
                if self.lost is not None:
                    return
                self._beat()
            except Exception as err:  # the store: a takeover needs a claim there, which the next look sees
                log.warning("owner lease heartbeat for %s failed (%s: %s)", self.storage.root, type(err).__name__, err)

    def _look_for_newer(self) -> None:
        found = epochs(self.storage)
        newest = read_claim(self.storage, found[-1]) if found else None
        if newest is not None and newest.record.get("token") == self.token:
            return
        if newest is not None and newest.epoch >= self.epoch:
            by = f"was claimed by {newest.describe()} ({newest.record.get('taken_because', '?')})"
        else:  # someone deleted our claim: whoever claims next counts from scratch
            by = f"lost its claim {_name('claim', self.epoch)} (deleted from {OWNER_DIR}/)"
        self.lost = f"the checkpoint root {self.storage.root} {by}: this driver no longer owns it and changes " \
                    "nothing more there"


def _watch(storage: Storage, claim: Claim) -> str:
    """Watch `claim`'s beat for one of its leases: the reason to take it, or OwnerAlive."""
    lease_s = float(claim.record["lease_s"])
    first = (claim.beat or {}).get("beat")
    deadline = time.monotonic() + lease_s + lease_s / BEATS_PER_LEASE
    while time.monotonic() < deadline:
        time.sleep(lease_s / BEATS_PER_LEASE / 2)
        now = read_claim(storage, claim.epoch)
        if (now.beat or {}).get("ended"):
            return f"its last owner ({claim.describe()}) released it"
        if (now.beat or {}).get("beat") != first:
            raise OwnerAlive(f"the checkpoint root {storage.root} is owned by a running job: {claim.describe()}, "
                             f"whose heartbeat advanced while we watched. Stop that job first, or give this one "
                             f"another `name` or `checkpoint.url`")
    return f"its last owner ({claim.describe()}) sent no heartbeat for {lease_s:.0f} s"
