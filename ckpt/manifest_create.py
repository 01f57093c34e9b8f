"""The store's part of a commit: a complete save's manifest created, retried once, a lost reply settled.

Protocol: ckpt.commit.Committer builds an `Attempt` for each complete save (`PendingSave`) and calls
`create_manifest(catalog, attempt, ...)` on whichever thread runs the create (the commit lane's, or
the controller's when inline); it changes no committer state, only the attempt it is given, which the
committer settles on the controller's thread. It returns the Manifest when the step is committed,
else None with `attempt.failed` (and `attempt.rejected`) or `attempt.skipped` saying why; it raises
IncompleteCheckpoint (the shards do not tile every tensor) and anything that is not the store's
failure (a lost owner lease, a bug).

The create is retried once: a retry that finds the manifest already there with the same shards is
our own first attempt that landed although its reply was lost (ckpt.catalog.Catalog.commit treats it
as success), and so is one found after both attempts failed (`landed`, read then with a retry budget:
the second attempt's own read-back may fail on a flapping store). A manifest that is there but does
not parse (found after a failed create, or by the create's own read-back, which raises
CorruptCheckpoint) is a torn write of ours; it is moved aside (`withdraw_torn`) before the retry and
after a failed one, so an unreadable manifest never stays where a reader would take the step for
committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ckpt.errors import CorruptCheckpoint, IncompleteCheckpoint, UnsupportedManifest
from ckpt.manifest import Manifest, ShardReceipt, merge_receipts
from ckpt.reader import read_manifest
from ckpt.storage import AlreadyCommitted
from ckpt.storage_errors import ReadRetry, storage_failure

log = logging.getLogger(__name__)
SETTLE_S = 10.0  # the read that settles whether a manifest whose creates both failed did land


@dataclass
class PendingSave:
    step: int
    started_at: float  # earliest wall time a rank began this save (estimated from its receipt)
    receipts: dict[int, ShardReceipt] = field(default_factory=dict)
    engine_state: dict | None = None
    samples: dict[int, list[int]] = field(default_factory=dict)  # rank -> its replica's sample digest


@dataclass
class Attempt:
    """What the store's part of a commit came to, settled on the controller's thread (`_settle`)."""

    save: PendingSave
    kept: bool  # the step is one of `left_behind` (committed by the history the restore left)
    manifest: Manifest | None = None  # committed
    committed_at: float = 0.0  # wall time the create returned
    skipped: str | None = None  # not committed through no failure: why (on_skipped)
    failed: str | None = None  # not committed: why (on_dropped)
    rejected: str | None = None  # ... and what `rejected` keeps of it
    unsure: bool = False  # failed with the store's errors: a stalled request of it may land later
    error: BaseException | None = None  # a lost owner lease, a bug: raised where it is settled



def create_manifest(catalog, attempt: Attempt, *, job: str, spec_hash: str, generation: int, layout: dict,
                    extra: dict, files_here: bool) -> Manifest | None:
    """Create the manifest of `attempt.save`, retrying once (see module doc); None when both attempts failed
    (`attempt.failed` says why), or when the step is one the history a restore left committed (`skipped`)."""
    save, errors = attempt.save, []
    for _ in range(2):
        try:
            return catalog.commit(
                job=job, step=save.step, generation=generation, layout=layout,
                spec_hash=spec_hash, receipts=list(save.receipts.values()),
                state={"engine": save.engine_state, **extra}, files_here=files_here,
            )
        except IncompleteCheckpoint:
            raise
        except Exception as err:  # storage errors (the HTTP stack's own among them); a torn manifest read back
            if isinstance(err, AlreadyCommitted) and attempt.kept:
                attempt.skipped = (f"step {save.step} is committed already, by the history this run left when "
                                   "its restore skipped that step; it is kept as it is")
                return None
            if not isinstance(err, CorruptCheckpoint) and not storage_failure(err):
                raise
            errors.append(f"{type(err).__name__}: {err}")
            log.warning("checkpoint step %d: manifest commit failed (%s)", save.step, errors[-1])
            withdraw_torn(catalog, save.step, attempt.kept)
    found = landed(catalog, save)
    if found is not None:
        return found
    attempt.rejected, attempt.failed = "; ".join(errors), f"the manifest commit failed twice ({errors[-1]})"
    attempt.unsure = True
    log.error("checkpoint step %d NOT committed: the manifest could not be created twice: %s",
              save.step, attempt.rejected)
    return None

def landed(catalog, save: PendingSave) -> Manifest | None:
    """After two failed creates: the manifest of `save` when one of them did land (its reply lost,
    and the retry's read-back failing too on a flapping store), read with a budget this time.
    Counting a committed save as failed would fail a job whose last save it is."""
    try:
        manifest = read_manifest(catalog, save.step, ReadRetry(SETTLE_S))
    except Exception as err:  # noqa: BLE001 (not there, unreadable, the store still failing: not landed)
        log.warning("checkpoint step %d: no manifest of ours found after the failed commits (%s: %s)",
                    save.step, type(err).__name__, err)
        return None
    same = manifest.tensors == merge_receipts(list(save.receipts.values()))
    return manifest if same else None

def withdraw_torn(catalog, step: int, kept: bool) -> None:
    """Move aside a manifest of `step` that is there but does not parse: our own torn write, or
    (`kept`: a step of `left_behind`) a committed one of the history this run left, quarantined."""
    try:
        if not catalog.storage.exists(catalog.manifest_path(step)):
            return
        # No retry budget: this runs mid-training (on the controller's thread when inline), and a
        # store that fails transiently here proves nothing (the warning below; restores check again).
        read_manifest(catalog, step, ReadRetry(0.0))
    except CorruptCheckpoint as err:
        try:
            # A step this run's restore skipped holds the previous history's committed manifest:
            # corrupt, not a torn write of ours; it goes aside as evidence (ckpt verify, retention keep it).
            aside = catalog.quarantine(step, unless_it_parses=True) if kept else \
                catalog.withdraw_torn(step)
            if aside is None:  # whole when read again: the first read's bytes were the store's fault
                log.warning("checkpoint step %d: the manifest read whole the second time (%s); it stays",
                            step, err)
            else:
                log.error("checkpoint step %d: unreadable manifest moved aside to %s (%s)", step, aside, err)
        except (OSError, ValueError) as again:
            log.error("checkpoint step %d: unreadable manifest could not be moved aside (%s); restores "
                      "will report and skip it", step, again)
    except Exception as err:
        if not isinstance(err, UnsupportedManifest) and not storage_failure(err):
            raise
        log.warning("checkpoint step %d: could not check the manifest after a failed commit (%s)", step, err)
