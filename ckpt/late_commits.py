"""Commits that land in a checkpoint root after their writer lost it.

A driver checks its owner lease just before it creates a manifest (ckpt.catalog.Catalog.commit),
but nothing bounds the time from that check to the create taking effect: a create stalled in a
client's retries, or left running when a driver released the root at its end, can land after the
next driver took the root over. Its manifest then names shards of another history (maybe of another
spec, maybe already collected as that driver's garbage), and a restore that took it for the newest
checkpoint would load it. The store offers no write conditional on another object (the lease), so
the holder that took the root tells such commits apart itself.

Protocol (orchestrator.controller.restore_policy.RestorePolicy, on the controller's thread):
  * Catalog.commit records the committing holder's claim in the manifest's state (`OWNER`: the
    lease's epoch, and its token, which tells two claims of one epoch apart after owner/ was wiped).
  * `LateCommits(catalog)` is made as the driver starts, right after it claimed the root: it lists
    the committed steps then, the root's history (a listing that fails is taken at the first
    `on_listing` instead).
  * `on_listing(committed)` with each later listing returns the steps that appeared since which
    this holder did not commit (their manifest carries another claim, or none): late commits, which
    this run neither restores nor counts. A manifest that does not read for the store's failures
    raises (the caller's retry budget applies); one that does not parse, or is another version's,
    is left to the restore, which reports it as such.
  * `on_committed(step)` for each commit of this holder's (booked): known from then on. One whose
    create landed without being booked (an answer lost on the way) is known by its claim.
"""

from __future__ import annotations

import logging

from ckpt.errors import CorruptCheckpoint, UnsupportedManifest

log = logging.getLogger(__name__)

OWNER = "owner"  # the manifest state's key: {"epoch", "token"} of the claim that committed it


class LateCommits:
    def __init__(self, catalog):
        self.catalog = catalog
        self.known: set[int] | None = None  # committed steps of the first listing, and this holder's own
        if catalog.owner_claim() is not None:
            try:
                self.known = set(catalog.committed_steps())
            except Exception as err:  # noqa: BLE001 (the store: the restore's own listing, with its retries)
                log.warning("could not list the committed checkpoints as the root was claimed (%s: %s); the "
                            "first restore's listing is taken as the root's history", type(err).__name__, err)

    def on_listing(self, committed: list[int]) -> list[int]:
        """The steps of `committed` that are late commits (none at the first listing, which sets `known`)."""
        if self.known is None:
            self.known = set(committed)
            return []
        late = []
        for step in (s for s in committed if s not in self.known):
            if self._committed_by_us(step):
                self.known.add(step)
            else:
                late.append(step)
        return late

    def on_committed(self, step: int) -> None:
        if self.known is not None:
            self.known.add(step)

    def _committed_by_us(self, step: int) -> bool:
        """Whether this holder committed `step`: its manifest carries our claim."""
        claim = self.catalog.owner_claim()
        if claim is None:
            return True  # no lease (a reader, a test): nobody else commits here
        try:
            state = self.catalog.read_manifest(step).state
        except (CorruptCheckpoint, UnsupportedManifest):
            return True  # the restore reads it, and reports what it is (quarantined, or another version's)
        return state.get(OWNER) == claim
