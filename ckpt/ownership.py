"""Who may change a checkpoint root: an owner lease, so that two controllers never run one job.

Two drivers of one job (a resubmission while the first still runs, two operators, a driver cut
off from the store and replaced) would both commit, retire and collect garbage in one folder.
Neither can damage a committed checkpoint (manifests are created exclusively), but each takes
the other's saves in flight for garbage, and their steps interleave. The lease makes one of
them the owner and stops the other.

Files under `<root>/owner/` (ckpt.owner_claims): `claim-<epoch>.json`, created exclusively
(Storage.create_exclusive) and never rewritten: who holds that epoch; `beat-<epoch>.json`,
rewritten by the holder every lease / 6. The newest claim is the owner.

Protocol. The driver calls `OwnerLease.claim(storage, holder, lease_s)` before anything writes
to the root; the catalog calls `lease.check()` before each change it makes (ckpt.catalog: a commit, a
retention or GC pass, a quarantine); the controller, and the parameter-server supervisor, read
`lease.lost` at each poll (a reason once a newer claim was seen: the job ends); the driver calls
`lease.release()` when the job ends, however it ends. The lease has its own Storage: faults
injected into the catalog's never reach it. `undying ckpt gc` holds a lease while it deletes;
`undying chaos --fresh` asks `owner_claims.live_owner` and then `refuse_a_beating_owner` first, and gc
`refuse_a_beating_owner`.

Claiming judges the newest claim (owner_claims.standing): none, released (its beat says ended) or
its process certainly gone (same host: ckpt.process_identity): claim at once. Its last beat older
than ten leases and ten minutes by the wall clock ("stale") compares two hosts' clocks, so a clock
far ahead here would take a live holder for dead: its beat is watched for a beat interval and a
half first. Otherwise its beat is watched for one of its leases and one beat interval on our
monotonic clock, so no two hosts' clocks are compared. Either way a beat that advances is a live
holder (OwnerAlive, naming it; nothing was written), a silent one a dead holder. Claiming creates
claim-<newest + 1>; a claimant that loses that race judges again.

Fencing: a holder that sees a newer claim (its heartbeat lists the claims at each beat, and
`check` lists them again) was judged dead while its store was unreachable for a lease, and
changes nothing more. What remains is a change made between a `check` and another's claim:
that needs our beats to fail for a whole lease while our commit path still reaches the store.
A failed beat is logged and ends nothing: a store outage is not a takeover, which needs a claim
in the store that the next check would see.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable

from ckpt import process_identity
from ckpt.owner_claims import (
    BEATS_PER_LEASE,
    OWNER_DIR,
    Claim,
    epochs,
    file_name,
    newest_claim,
    read_beat,
    read_claim,
    standing,
    taken_because,
    watch_s,
)
from ckpt.storage import AlreadyCommitted, Storage
from ckpt.storage_errors import describe, is_transient

log = logging.getLogger(__name__)

KEEP_CLAIMS = 8  # older claims are deleted at release: the recent owners stay as a record
RELEASE_WAIT_S = 5.0  # how long a release waits for a heartbeat in flight


class OwnerAlive(RuntimeError):
    """The root is held by a process whose heartbeat advanced while we watched: nothing was claimed."""


class OwnershipLost(RuntimeError):
    """A newer claim took the root: this holder must change nothing more."""


class OwnershipUncertain(OSError):
    """This holder's beats have not reached the store for a lease: a claimant may be about to take the
    root, so nothing is changed there until a beat lands. A store failure in effect (the save fails,
    GC waits for the next commit), not a loss."""


class OwnerLease:
    """This process's claim on a checkpoint root, kept alive by a heartbeat thread."""

    def __init__(self, storage: Storage, epoch: int, holder: str, lease_s: float):
        self.storage, self.epoch, self.holder, self.lease_s = storage, epoch, holder, lease_s
        self.lost: str | None = None
        self.released = False
        self.token = uuid.uuid4().hex  # tells our claim from one of the same epoch made after a wipe
        self._beats = 0
        self._beat_at = time.monotonic()  # when the last beat that landed was sent (monotonic: a pause shows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="undying-owner-lease", daemon=True)

    @classmethod
    def claim(cls, storage: Storage, holder: str, lease_s: float,
              say: Callable[[str], None] = lambda line: None) -> OwnerLease:
        """Own `storage`'s root (module doc), or raise OwnerAlive; `say` hears why a claim waits.
        Storage errors and UnreadableClaim (a claim file that does not parse) are raised as they come."""
        for _ in range(5):  # each turn loses a race to another claimant, or watches a holder that vanished
            newest = newest_claim(storage)
            reason = "no owner" if newest is None else _reason_to_take(storage, newest, say)
            if reason is None:
                continue
            lease = cls(storage, (newest.epoch + 1) if newest else 0, holder, lease_s)
            if lease._create(reason):
                return lease
        raise OwnerAlive(f"the checkpoint root {storage.root} keeps being claimed by others; try again")

    def _create(self, reason: str) -> bool:
        record = {"holder": self.holder, "process": process_identity.this_process(), "lease_s": self.lease_s,
                  "claimed_at": time.time(), "taken_because": reason, "token": self.token}
        try:
            self.storage.create_exclusive(self.storage.path(OWNER_DIR, file_name("claim", self.epoch)),
                                          json.dumps(record).encode())
        except AlreadyCommitted:
            return False
        try:
            self._beat()
            self._thread.start()
            log.info("owner of %s (epoch %d): %s", self.storage.root, self.epoch, reason)
        except BaseException:  # the store, or a signal: the caller gives up, so end the claim it made
            self._stop.set()  # a heartbeat already started beats no more
            with contextlib.suppress(Exception):  # (best effort) that the next claimant need not wait for it
                self._beat(ended=True)
            raise
        return True

    def check(self) -> None:
        """Raise OwnershipLost unless this holder still owns the root (lists the claims now), and
        OwnershipUncertain when its last beat landed over a lease ago: a claimant takes the root
        after watching the beat stand still for `watch_s` (a lease and a beat), so this holder stops
        changing anything a beat before that can happen (a store that refuses its beats, a pause)."""
        if self.released:
            raise OwnershipLost(f"this driver released its lease on {self.storage.root}: it changes nothing more there")
        if self.lost is None:
            self._look_for_newer()
        if self.lost is not None:
            raise OwnershipLost(self.lost)
        quiet = time.monotonic() - self._beat_at
        if quiet > self.lease_s:
            raise OwnershipUncertain(f"the owner heartbeat of {self.storage.root} has not landed for {quiet:.0f} s "
                                     f"(lease {self.lease_s:g} s): nothing is changed there until one does")

    def release(self) -> None:
        """Stop the heartbeat and mark the claim ended, so the next claimant need not wait; prune old
        claims. A heartbeat stuck in the store for RELEASE_WAIT_S is left behind: the claim then expires.
        From here `check` raises: background store work the run's end gave up waiting for (a retention
        pass, a create on a hung store) must change nothing in a root the next claimant takes at once."""
        self.released = True
        self._stop.set()
        if self._thread.is_alive():  # not for a beat stuck in the store: a release must fit in a pod's grace
            self._thread.join(timeout=min(self.lease_s, RELEASE_WAIT_S))
        if self.lost is not None or self._thread.is_alive():
            return
        try:
            self._beat(ended=True)
            self._prune()
        except Exception as err:  # the store; the claim then expires on its own
            log.warning("could not release the owner lease of %s (%s: %s); the next run waits for it to expire",
                        self.storage.root, type(err).__name__, err)

    def _prune(self) -> None:
        """Delete the claims, beats and leftover temporary files of all but the KEEP_CLAIMS newest epochs."""
        keep_from = (epochs(self.storage) or [0])[-KEEP_CLAIMS:][0]
        for name in self.storage.listdir(self.storage.path(OWNER_DIR)):
            number = name.split("-", 1)[-1].split(".", 1)[0]
            if name.startswith(("claim-", "beat-")) and number.isdigit() and int(number) < keep_from:
                self.storage.remove(self.storage.path(OWNER_DIR, name))

    def _beat(self, ended: bool = False) -> None:
        self._beats += 1
        beat, sent = {"beat": self._beats, "time": time.time(), "ended": ended}, time.monotonic()
        self.storage.write_immutable(self.storage.path(OWNER_DIR, file_name("beat", self.epoch)),
                                     json.dumps(beat).encode())
        # From its sending: a watcher saw it land then, however late the store's answer came back.
        self._beat_at = sent

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / BEATS_PER_LEASE):
            try:
                self._beat()  # first: a look that fails must not cost a beat
                self._look_for_newer()
            except Exception as err:  # the store: a takeover needs a claim there, which the next look sees
                log.warning("owner lease heartbeat for %s failed (%s: %s)", self.storage.root, type(err).__name__, err)
            if self.lost is not None:
                return

    def _look_for_newer(self) -> None:
        found = epochs(self.storage)
        newest = read_claim(self.storage, found[-1], with_beat=False) if found else None
        if newest is not None and newest.record.get("token") == self.token:
            return
        if newest is not None and newest.epoch >= self.epoch:
            by = f"was claimed by {newest.describe()} ({newest.record.get('taken_because', '?')})"
        else:  # someone deleted our claim (whoever claims next counts from scratch), or the listing lied
            try:  # (a remounting share, a failing-over store lists nothing): our claim, read by its name
                ours = read_claim(self.storage, self.epoch, with_beat=False)
            except FileNotFoundError as err:
                if is_transient(err):  # the bucket itself is missing (S3 NoSuchBucket): no proof of a deletion
                    raise OwnershipUncertain(f"the store says the bucket of {self.storage.root} does not exist "
                                             f"({describe(err)}); looking again") from err
                ours = None
            if ours is not None and ours.record.get("token") == self.token:
                raise OwnershipUncertain(f"the listing of {OWNER_DIR}/ under {self.storage.root} showed "
                                         f"{found or 'nothing'}, not our claim, which reads intact; looking again")
            by = f"lost its claim {file_name('claim', self.epoch)} (deleted from {OWNER_DIR}/)"
        self.lost = f"the checkpoint root {self.storage.root} {by}: this driver no longer owns it and changes " \
                    "nothing more there"


def _reason_to_take(storage: Storage, newest: Claim, say: Callable[[str], None]) -> str | None:
    """Why `newest` may be taken over (at once, or after watching its beat), None when it vanished
    meanwhile (judge again), or OwnerAlive."""
    state = standing(newest, time.time())
    if state == "stale":  # by two hosts' wall clocks: a clock far ahead here makes a live holder look stale
        try:
            _glance(storage, newest)  # OwnerAlive if it beats
        except FileNotFoundError:
            return None
    if state == "running":
        say(f"the checkpoint root is held by {newest.describe()}; watching its heartbeat for up to "
            f"{watch_s(newest.lease_s):.0f} s to tell whether it still runs")
        try:
            state = _watch(storage, newest)
        except FileNotFoundError:
            return None
    return taken_because(newest, state, time.time())


def refuse_a_beating_owner(storage: Storage) -> None:
    """Raise OwnerAlive when the root's holder, not known to have stopped, beats within a beat
    interval and a half: the cheap look a long read takes before it claims (`undying ckpt gc`
    verifies for minutes, to be refused after that by a job that runs). A holder silent that long
    is not judged dead here: the claim's own watch does that, for a whole lease."""
    claim = newest_claim(storage)
    if claim is not None and standing(claim, time.time()) in ("running", "stale"):  # stale: by two hosts' clocks
        with contextlib.suppress(FileNotFoundError):  # it vanished: nobody holds the root
            _glance(storage, claim)


def _glance(storage: Storage, claim: Claim) -> str:
    """`_watch` for a beat interval and a half: long enough to see a live holder's beat advance."""
    return _watch(storage, claim, for_s=1.5 * claim.lease_s / BEATS_PER_LEASE)


def _watch(storage: Storage, claim: Claim, for_s: float | None = None) -> str:
    """Watch `claim`'s beat for `for_s`, by default one of its leases and one beat interval:
    "released" or "silent", or OwnerAlive."""
    first = (claim.beat or {}).get("beat")
    deadline = time.monotonic() + (watch_s(claim.lease_s) if for_s is None else for_s)
    while time.monotonic() < deadline:
        time.sleep(claim.lease_s / BEATS_PER_LEASE / 2)
        storage.read(storage.path(OWNER_DIR, file_name("claim", claim.epoch)))  # FileNotFoundError: it vanished
        beat = read_beat(storage, claim.epoch) or {}
        if beat.get("ended"):
            return "released"
        if beat.get("beat", first) != first:
            raise OwnerAlive(f"the checkpoint root {storage.root} is held by {claim.describe()}, whose heartbeat "
                             f"advanced while we watched: it still runs. Wait for it to end (or stop it), or give "
                             f"this job another `name` or `checkpoint.url`")
    return "silent"
