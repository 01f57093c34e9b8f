"""Which checkpoint a generation restores, and what a failed restore proves.

Protocol (controller thread only; `Checkpoints` owns one and the controller's RESTORING handler
drives it through Checkpoints):
  * `restore_point()`: the newest committed step this run has not found unusable; a late commit of
    a driver that had lost the root is moved aside first (ckpt.late_commits). None (start
    from step 0) only when the root never held a checkpoint, or with `undying run --fresh`.
    Raises NoRestorePoint when committed checkpoints exist (or this root's were all quarantined)
    and none is left to try: the job fails naming them, it never starts over on its own.
  * `on_corrupt(step, err)` when a rank or the controller proved checkpoint `step` corrupt (a
    checksum mismatch, a shard the manifest names is missing, a short read, a manifest that does
    not parse): the step is skipped by this run, and quarantined (its manifest moved aside,
    ckpt.catalog.Catalog.quarantine) only when the controller's own verification proves the
    corruption too: of the bytes the rank's error names (`CorruptCheckpoint.location`:
    milliseconds, where reading a large checkpoint whole would hold the recovery for minutes),
    else of the whole checkpoint. Returns the line to print: a fallback is always loud.
  * `verify_fully(step)`: a whole verification, for a step skipped that way which the job
    needs as its final checkpoint (orchestrator.controller.stopping); `kept_intact(step, ...)` asks
    that, and whether this very spec saved it.
  * `unreadable(step, err)` when a restore failed with TransientStorageError (the store kept
    failing past `checkpoint.read_retry_s`), NoRestorePoint or UnsupportedManifest (another
    undying version's checkpoint): the words the job fails with.

A verification that itself meets transient errors proves nothing: it is retried for the same
budget, and if the store still fails, the manifest stays where it is. Nothing here deletes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from ckpt.errors import CorruptCheckpoint, TransientStorageError, UnsupportedManifest, location_of
from ckpt.late_commits import LateCommits
from ckpt.manifest import MANIFEST_NAME
from ckpt.reader import read_manifest, verify_checkpoint, verify_location
from ckpt.storage_errors import ReadRetry
from trainer.checkpoint_match import CheckpointMismatch
from trainer.urls import RangeIgnored

log = logging.getLogger(__name__)

FRESH_HINT = "`undying run --fresh` starts from step 0 (docs/design.md, restore)"


class NoRestorePoint(RuntimeError):
    """Committed checkpoints exist (or were quarantined) and none of them can be restored."""


# What a restore may fail with that proves nothing about a checkpoint's bytes: the job fails.
# A manifest another undying version wrote is not damage either: the job fails naming the version;
# nor is a store that ignores Range requests, which every rerun would meet again; nor a checkpoint of
# another model, trajectory or data than the spec's (a restore retried, or recovered, refuses again).
UNRESTORABLE = (TransientStorageError, NoRestorePoint, UnsupportedManifest, RangeIgnored, CheckpointMismatch)


def cause(err: BaseException) -> str:
    """`err` in one line, the rank's own exception when Ray wrapped it (its str is a traceback)."""
    inner = getattr(err, "cause", None)
    inner = inner if isinstance(inner, BaseException) else err
    return f"{type(inner).__name__}: {inner}" if not isinstance(inner, (CorruptCheckpoint, NoRestorePoint)) \
        else str(inner)


def fresh_problem(spec) -> str | None:
    """Why `undying run --fresh` must not start this job, or None. Committed checkpoints in its root
    would collide with the fresh run's step numbers and fall to its retention, so they are in the way;
    the flag never deletes or moves one (a fresh start elsewhere: another job name)."""
    from orchestrator.rank.state import catalog_for

    committed = catalog_for(spec).committed_steps()
    if not committed:
        return None
    return (f"{spec.checkpoint_root} holds committed checkpoints (steps {committed}); a fresh run there would reuse "
            f"their step numbers and its retention would delete them: rerun without --fresh to resume from step "
            f"{committed[-1]}, or start from step 0 under another name (--set name=...), which leaves them intact")


class RestorePolicy:
    def __init__(self, catalog, read_retry_s: float, fresh: bool = False, interrupt=None):
        self.catalog = catalog
        # The settings; each listing, read or verification spends a fresh() one. `interrupt` (between
        # retries) raises to give them up: the controller's when the job is ending.
        self.retry = ReadRetry(read_retry_s, interrupt=interrupt)
        self.fresh = fresh  # --fresh: an empty root (checkpoints all quarantined) may start from step 0
        self.bad: dict[int, str] = {}  # committed steps this run will not restore -> why
        self.late = LateCommits(catalog)  # commits landed after their writer lost the root
        self.intact: set[int] = set()  # those of them the controller's own verification read intact

    def read_manifest(self, step: int):
        return read_manifest(self.catalog, step, self.retry.fresh())

    def resumed(self, anchor: int | None):
        """The manifest a run's first restore resumed, read once, without retries; None for a fresh start
        or one that does not read now (what it informs, the resumed commit's age and the weights the job
        started from, then falls back: the metric keeps the job's start, the weights are the spec's)."""
        with contextlib.suppress(Exception):
            return self.catalog.read_manifest(anchor) if anchor is not None else None
        return None

    def restore_point(self) -> int | None:
        retry = self.retry.fresh()
        listed = retry.call(self.catalog.committed_steps, "listing the committed checkpoints")
        left_out = retry.call(lambda: self.late.on_listing(listed), "reading who committed the new checkpoints")
        committed = [s for s in listed if s not in left_out]  # (late commits, moved aside: ckpt.late_commits)
        candidates = [s for s in committed if s not in self.bad]
        if candidates:
            return candidates[-1]
        if self.bad:
            tried = "; ".join(why if s is None else f"step {s}: {why}"
                              for s, why in sorted(self.bad.items(), key=lambda item: item[0] or -1, reverse=True))
            hint = FRESH_HINT if not committed else "rerun to try them again, or start over under another name " \
                                                    "(--set name=...)"
            raise NoRestorePoint(f"no committed checkpoint can be restored ({tried}); nothing was deleted and the "
                                 f"job does not start from step 0 on its own: {hint}")
        if self.fresh:
            return None
        quarantined = retry.call(self.catalog.quarantined_steps, "listing the quarantined checkpoints")
        if quarantined:
            raise NoRestorePoint(f"{self.catalog.storage.root} holds no committed checkpoint, but the manifests of "
                                 f"steps {quarantined} were quarantined as corrupt (moved aside, kept as evidence); "
                                 f"the job does not start from step 0 on its own: {FRESH_HINT}")
        return None

    def on_committed(self, step: int) -> None:
        self.late.on_committed(step)
        self.bad.pop(step, None)  # a quarantined step saved and committed again is good
        self.intact.discard(step)

    def on_corrupt(self, step: int, err: BaseException) -> str:
        why = cause(err)
        log.error("checkpoint step %s failed to load (%s); falling back to the previous one", step, why)
        location = location_of(err)
        if step is None:  # model.from_hf's weights: nothing of ours to check, move aside or fall back to
            self.bad[step] = f"model.from_hf's weights do not read intact ({why})"
            return f"model.from_hf's weights do not read intact ({why}); nothing is committed to fall back to"
        words = self._quarantine(step, location)
        self.bad[step] = f"corrupt ({why}){words}"
        return f"checkpoint step {step} is corrupt ({why}); falling back to the previous committed one{words}"

    def verify_fully(self, step: int) -> bool:
        """Whether committed checkpoint `step` verifies whole here (then it joins `intact`)."""
        try:
            verify_checkpoint(self.catalog, step, self.retry.fresh())
        except Exception as err:  # corrupt, or a store that kept failing: not intact either way
            log.warning("checkpoint step %s does not verify whole: %s", step, cause(err))
            return False
        self.intact.add(step)
        return True

    def _withdraw(self, step: int) -> str:
        try:
            return f"; its manifest moved aside to {self.catalog.quarantine(step)}"
        except Exception as err:  # the storage failed the move: the step stays committed, skipped
            return f"; it could not be moved aside ({type(err).__name__}: {err}), skipped by this run"

    def _quarantine(self, step: int, location: tuple[str, int, int] | None) -> str:
        """Withdraw a checkpoint only when the controller's own verification proves it corrupt: of the
        bytes the rank's error names (`location`: a large checkpoint's full verification would hold
        the recovery for as long as reading all of it), else of the whole checkpoint. One that
        verifies (the rank's read was damaged in flight), or that the store keeps the controller from
        verifying, stays committed and is only skipped by this run."""
        what = "verification" if location is None else "check"
        try:
            if location is None:
                verify_checkpoint(self.catalog, step, self.retry.fresh())
            else:
                verify_location(self.catalog, step, location, self.retry.fresh())
        except CorruptCheckpoint:
            return self._withdraw(step)
        except Exception as err:  # TransientStorageError or another storage error: no proof
            return (f"; its {what} here failed without proving corruption ({type(err).__name__}: {err}), so it "
                    "stays committed (skipped by this run)")
        if location is not None:
            file, start, end = location
            what = "its manifest reads" if file == MANIFEST_NAME else f"bytes {start}..{end} of {file} read"
            return f"; {what} intact here (the rank's read was damaged), so it stays committed (skipped by this run)"
        self.intact.add(step)
        return "; it verifies here, so it stays committed (skipped by this run)"

    def unreadable(self, step: int | None, err: BaseException) -> str:
        if isinstance(err, NoRestorePoint):
            return str(err)
        if isinstance(err, UnsupportedManifest | RangeIgnored | CheckpointMismatch):
            return f"{cause(err)}; nothing was quarantined or deleted"
        what = f"checkpoint step {step}" if step is not None else "the committed checkpoints"
        return (f"{what} could not be read ({cause(err)}); that proves nothing about the bytes, so nothing was "
                "quarantined or deleted: rerun once the store answers")

    def kept_intact(self, step: int, spec_hash: str, say: Callable[[str], None]) -> bool:
        """Whether committed `step`, skipped by this run's restore, was saved by a run of spec `spec_hash`
        (the restore's own checks of its state never ran: its read failed first) and verifies whole (checked
        now when only the damaged bytes were); `say` prints why not."""
        try:
            saved = self.read_manifest(step).spec_hash
        except Exception as err:  # unreadable now: not this job's final checkpoint as far as we know
            say(f"checkpoint step {step}: its manifest does not read ({type(err).__name__}: {err})")
            return False
        if saved != spec_hash:
            say(f"checkpoint step {step} was committed by a run of another spec (spec hash {saved[:12]}, "
                f"this run's {spec_hash[:12]}): not taken as this job's final checkpoint")
            return False
        return step in self.intact or self.verify_fully(step)
