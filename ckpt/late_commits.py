"""Commits that land in a checkpoint root after their writer lost it.

A driver checks its owner lease just before it creates a manifest (ckpt.catalog.Catalog.commit),
but nothing bounds the time from that check to the create taking effect: a create stalled in a
client's retries, or left running when a driver released the root at its end, can land after the
next driver took the root over. Its manifest then names shards of another history (maybe of another
spec, maybe already collected as that driver's garbage), and a restore that took it for the newest
checkpoint would load it. The store offers no write conditional on another object (the lease), so
the holder that took the root tells such commits apart itself.

Protocol:
  * Catalog.commit records the committing holder's claim in the manifest's state (`OWNER`: the
    lease's epoch, and its token, which tells two claims of one epoch apart after owner/ was wiped).
  * `record_history(catalog, retry)`: the driver, right after it claimed the root and before
    anything else touches the store, lists the committed steps: the root's history. A listing the
    store keeps failing fails the start (orchestrator.cli.run), as a claim that cannot land does.
  * `LateCommits(catalog)` (orchestrator.controller.restore_policy.RestorePolicy, on the
    controller's thread): `on_listing(committed)` with each restore's listing returns the steps to
    leave out. A step that appeared since the history, which this holder did not commit (its
    manifest carries another claim, or none), is a late commit: its manifest is moved aside (under
    the lease's fence) as `manifest.late-<ms>-<random>.json`, kept as evidence with its shards, so
    that no run restores or counts it and the job's own save of that step commits. A manifest gone
    since the listing is left out too. One that does not read for the store's failures raises (the
    caller's retry budget applies); one that does not parse, or is another version's, is left to
    the restore, which reports it as such.
  * `on_committed(step)` for each commit of this holder's (booked): known from then on. One whose
    create landed without being booked (an answer lost on the way) is known by its claim.
  * A save of this holder's that finds a late commit at its step (one that landed after the last
    restore's listing) moves it aside and creates its own (Catalog.commit, `is_late`).
A catalog without a recorded history (a reader's, a test's) judges nothing late.
"""

from __future__ import annotations

import logging

from ckpt.errors import CorruptCheckpoint, UnsupportedManifest
from ckpt.storage_errors import storage_failure

log = logging.getLogger(__name__)

OWNER = "owner"  # the manifest state's key: {"epoch", "token"} of the claim that committed it
LATE_PREFIX = "manifest.late-"  # a late commit's manifest, moved aside: manifest.late-<ms>-<random>.json
_LATE = ("checkpoint step %d was committed by a driver that no longer owned this root (its manifest landed after this "
         "run took the root over)")


def record_history(catalog, retry) -> None:
    """The committed steps of `catalog`'s root now, as its owner's history (`catalog.history`)."""
    catalog.history = set(retry.call(catalog.committed_steps, "listing the committed checkpoints as the root "
                                                              "was claimed"))


def is_late(catalog, step: int, state: dict) -> bool:
    """Whether committed `step`, whose manifest state is `state`, is a late commit: not in the history of
    `catalog`'s owner (None: not known, so no) and not carrying its claim."""
    return catalog.history is not None and step not in catalog.history and state.get(OWNER) != catalog.owner_claim()


def withdraw(catalog, step: int) -> None:
    """Move the late commit `step` aside (Catalog.withdraw_late), saying so. A move the store refuses (or
    that finds the manifest gone) is said too, and the step stays late for this run: OwnershipLost alone
    is raised (the root is another's now)."""
    try:
        aside = catalog.withdraw_late(step)
    except Exception as err:
        if not storage_failure(err):
            raise
        log.warning("%s; moving it aside failed (%s: %s): this run neither restores nor counts it", _LATE % step,
                    type(err).__name__, err)
        return
    log.warning("%s: moved aside to %s, kept with its shards as evidence; no run restores or counts it",
                _LATE % step, aside)


class LateCommits:
    def __init__(self, catalog):
        self.catalog = catalog
        self.known: set[int] = set(catalog.history or ())  # the root's history and this holder's own commits

    def on_listing(self, committed: list[int]) -> set[int]:
        """The steps of `committed` to leave out: late commits (moved aside), and manifests gone since.
        Without a recorded history (a reader's catalog, a test's) nothing is judged."""
        if self.catalog.history is None:
            return set()
        out = set()
        for step in (s for s in committed if s not in self.known):
            try:
                state = self.catalog.read_manifest(step).state
            except FileNotFoundError:
                out.add(step)  # deleted since the listing (`undying ckpt gc`): not there to restore
                continue
            except (CorruptCheckpoint, UnsupportedManifest):
                self.known.add(step)  # the restore reads it, and says what it is (quarantined, another version's)
                continue
            if is_late(self.catalog, step, state):
                out.add(step)
                withdraw(self.catalog, step)
            else:
                self.known.add(step)
        return out

    def on_committed(self, step: int) -> None:
        self.known.add(step)
