"""Commits that land in a checkpoint root after their writer lost it.

A driver checks its owner lease just before it creates a manifest (ckpt.catalog.Catalog.commit),
but nothing bounds the time from that check to the create taking effect: a create stalled in a
client's retries, or left running when a driver released the root at its end, can land after the
next driver took the root over. Its manifest then names shards of another history (maybe of another
spec, maybe already collected as that driver's garbage), and a restore that took it for the newest
checkpoint would load it. The store offers no write conditional on another object (the lease), so
the holder that took the root tells such commits apart itself.

Protocol (the holder's controller thread: orchestrator.controller.restore_policy.RestorePolicy):
  * Catalog.commit records the committing holder's lease epoch in the manifest's state
    (`OWNER_EPOCH`).
  * `on_listing(committed)` with each listing of the committed steps; the first records them as
    known (whatever was committed before this holder looked is the root's history), and each later
    one returns the steps that appeared since which this holder did not commit (their manifest
    carries another epoch, or none): late commits, which this run neither restores nor deletes.
  * `on_committed(step)` for each commit of this holder's (booked): known from then on. One whose
    create landed without being booked (an answer lost on the way) is known by its epoch.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

OWNER_EPOCH = "owner_epoch"  # the manifest state's key: the lease epoch of the holder that committed it


class LateCommits:
    def __init__(self, catalog):
        self.catalog = catalog
        self.known: set[int] | None = None  # committed steps of the first listing, and this holder's own

    def on_listing(self, committed: list[int]) -> list[int]:
        """The steps of `committed` that are late commits (none at the first listing, which sets `known`)."""
        if self.known is None:
            self.known = set(committed)
            return []
        late = []
        for step in (s for s in committed if s not in self.known):
            ours = self._committed_by_us(step)
            if ours:
                self.known.add(step)
            elif ours is False:
                late.append(step)
        return late

    def on_committed(self, step: int) -> None:
        if self.known is not None:
            self.known.add(step)

    def _committed_by_us(self, step: int) -> bool | None:
        """Whether this holder committed `step` (its manifest carries our epoch); None when that cannot
        be told now (the manifest does not read: the restore that reads it finds out what it is)."""
        epoch = self.catalog.owner_epoch()
        if epoch is None:
            return True  # no lease (a reader, a test): nobody else commits here
        try:
            state = self.catalog.read_manifest(step).state
        except Exception as err:  # noqa: BLE001 (the store, a torn manifest: judged by the restore's own read)
            log.warning("could not tell who committed checkpoint step %d (%s: %s)", step, type(err).__name__, err)
            return None
        return state.get(OWNER_EPOCH) == epoch
