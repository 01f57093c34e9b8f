"""The claims under a checkpoint root's `owner/` folder: reading them, and judging their holders.

Written by ckpt.ownership.OwnerLease (the only writer); read by it, by `undying ckpt ls`
(`owner_status`) and by the tools that delete (`live_owner`). Files, per epoch:
`claim-<epoch>.json`, created once, {"holder", "process" (ckpt.process_identity), "lease_s",
"claimed_at", "taken_because", "token"}; `beat-<epoch>.json`, rewritten by the holder,
{"beat": n, "time": wall seconds, "ended": bool}. The newest claim owns the root.

A beat that does not parse (a write torn by a crash or a faulty store) reads as no beat: the
holder's next beat replaces it, and a claimant then watches for one. A claim that does not parse
raises UnreadableClaim: nobody can tell who owns the root, and a person must look.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckpt import process_identity
from ckpt.storage import Storage

log = logging.getLogger(__name__)

OWNER_DIR = "owner"
BEATS_PER_LEASE = 6  # the holder beats every lease / 6
STALE_LEASES = 10  # a beat this many leases old by the wall clock is a dead holder's, without watching
STALE_FLOOR_S = 600.0  # ... and at least this old, so that hosts' clocks may differ by minutes


class UnreadableClaim(ValueError):
    """A claim file that does not parse as a claim: who holds the root is unknown."""


def watch_s(lease_s: float) -> float:
    """How long a claimant watches a holder's beat before it takes it for dead: a lease and one beat."""
    return lease_s * (1 + 1 / BEATS_PER_LEASE)


@dataclass
class Claim:
    epoch: int
    record: dict  # holder, process, lease_s, claimed_at, taken_because, token
    beat: dict | None  # the holder's newest beat; None before its first (or when it does not parse)

    @property
    def host(self) -> str:
        return str(self.record.get("process", {}).get("host", "?")).split("/")[0]

    @property
    def pid(self):
        return self.record.get("process", {}).get("pid", "?")

    def describe(self) -> str:
        return f"{self.record.get('holder', '?')} on host {self.host}, pid {self.pid}"

    @property
    def lease_s(self) -> float:
        return float(self.record.get("lease_s", 0.0))

    def last_seen(self) -> float:
        return float((self.beat or {}).get("time", self.record.get("claimed_at", 0.0)))


def file_name(kind: str, epoch: int) -> str:
    return f"{kind}-{epoch:010d}.json"


def epochs(storage: Storage) -> list[int]:
    """The epochs claimed under `storage`'s root, oldest first."""
    found = []
    for name in storage.listdir(storage.path(OWNER_DIR)):
        stem = name.removeprefix("claim-").removesuffix(".json")
        if name.startswith("claim-") and name.endswith(".json") and stem.isdigit():
            found.append(int(stem))
    return sorted(found)


def read_claim(storage: Storage, epoch: int, with_beat: bool = True) -> Claim:
    path = storage.path(OWNER_DIR, file_name("claim", epoch))
    try:
        record = json.loads(storage.read(path))
    except ValueError as err:
        raise UnreadableClaim(f"{path} does not parse ({err})") from None
    if not isinstance(record, dict):
        raise UnreadableClaim(f"{path} holds a {type(record).__name__}, not a claim")
    return Claim(epoch, record, read_beat(storage, epoch) if with_beat else None)


def read_beat(storage: Storage, epoch: int) -> dict | None:
    try:
        beat = json.loads(storage.read(storage.path(OWNER_DIR, file_name("beat", epoch))))
    except (FileNotFoundError, ValueError):
        return None
    return beat if isinstance(beat, dict) else None


def newest_claim(storage: Storage, with_beat: bool = True) -> Claim | None:
    found = epochs(storage)
    return read_claim(storage, found[-1], with_beat) if found else None


def standing(claim: Claim, now: float, gone: Callable[[dict], bool] = process_identity.gone) -> str:
    """"released", "gone" (its process certainly ended), "stale" (its last beat older than
    STALE_LEASES leases and STALE_FLOOR_S by the wall clock) or "running" (not known to have
    stopped: a claimant must watch its beat)."""
    if (claim.beat or {}).get("ended"):
        return "released"
    if gone(claim.record.get("process", {})):
        return "gone"
    if now - claim.last_seen() > max(STALE_LEASES * claim.lease_s, STALE_FLOOR_S):
        return "stale"
    return "running"


def taken_because(claim: Claim, state: str, now: float) -> str:
    """The words a new claim records for taking over `claim` in `state`."""
    why = {"released": "released it", "gone": "is no longer running",
           "stale": f"was last seen {now - claim.last_seen():.0f} s ago",
           "silent": f"sent no heartbeat for {claim.lease_s:.0f} s"}[state]
    return f"its last owner ({claim.describe()}) {why}"


def owner_status(storage: Storage) -> dict | None:
    """The newest claim on `storage`'s root as plain data (`undying ckpt ls`), None when never claimed:
    holder, host, pid, epoch, lease_s, seconds since its last beat and its `standing`."""
    claim = newest_claim(storage)
    if claim is None:
        return None
    now = time.time()
    return {"holder": claim.record.get("holder"), "host": claim.host, "pid": claim.pid,
            "epoch": claim.epoch, "lease_s": claim.lease_s, "last_beat_age_s": round(now - claim.last_seen(), 3),
            "standing": standing(claim, now)}


def live_owner(storage: Storage) -> str | None:
    """Who holds `storage`'s root and is not known to have stopped, for `undying chaos --fresh`
    (a laptop's tool: a dead holder on the same host is known at once); None when nobody does."""
    claim = newest_claim(storage)
    if claim is None or standing(claim, time.time()) != "running":
        return None
    return f"{claim.describe()} (last heartbeat {time.time() - claim.last_seen():.0f} s ago)"


def visibility_proof(storage: Storage) -> tuple[str, str] | None:
    """(the path of the newest claim, its token) for a root on a filesystem (file://), which another
    node's process checks with `sees_claim` before it trains: a root on storage only the driver's node
    has (/tmp on a multi-node cluster) would take every other node's shards onto their own disks, and
    no commit would ever find them. None for an object store (one namespace everywhere) or no claim."""
    if not storage.is_local:
        return None
    claim = newest_claim(storage, with_beat=False)
    token = claim.record.get("token") if claim is not None else None
    return (storage.path(OWNER_DIR, file_name("claim", claim.epoch)), token) if isinstance(token, str) else None


def sees_claim(proof: tuple[str, str]) -> bool:
    """Whether this process finds the claim of `visibility_proof` at its path, with its token. Only proof
    says no: no such file there, or another claim (an older run's folder of the same path); a read
    that fails otherwise (a shared mount failing over: EIO, ESTALE) is logged and says yes, since the
    commits will meet the same mount and say what it does."""
    path, token = proof
    try:
        with open(path, encoding="utf-8") as claim:
            record = json.load(claim)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    except OSError as err:
        log.warning("could not read %s to check this node sees the checkpoint root: %s", path, err)
        return True
    return isinstance(record, dict) and record.get("token") == token
