"""Controller side of checkpoints: commit manifests, find the latest committed one, retention.

Protocol: only the controller calls `commit`, after it holds one `ShardReceipt` from every
rank of the generation for that step. The manifest is created last and exclusively, so a
checkpoint either exists whole or not at all (docs/design.md invariant 1). `committed_steps`
derives "latest" from committed manifests alone; a directory without a manifest is an
unfinished save, invisible to readers and removed by `collect_garbage`.

Retention and garbage collection (`plan_gc`, then `apply_gc`; `apply_retention` and
`collect_garbage` are its two halves) keep the newest K committed checkpoints, never the
newest committed one, and delete unfinished saves older than the newest commit. The
committer's retention counts only steps up to the job's own newest commit: steps above it
belong to a history the job left at its restore and are kept as they are. A
checkpoint is deleted manifest first, so an interrupted deletion leaves an uncommitted
directory (garbage for the next run), never a manifest that names missing shards. On S3 an
unfinished save also counts when all it left is multipart uploads pending (a writer killed
mid-upload): deleting it aborts them (ckpt.storage.Storage.remove_tree). Deletes
tolerate files that are already gone: the controller and `undying ckpt gc` may race. A
listing or a manifest stat that fails raises before anything is deleted (Storage.exists says
"absent" only when the store does), so GC never takes a committed step it could not see for
an unfinished save; the caller logs it (the committer runs GC again at its next commit). Under a
lease, a root listed without the lease's directory is such a failure too (RootNotListed): a root
that vanished from the store's answers is not a job without checkpoints.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from ckpt.errors import CorruptCheckpoint, IncompleteCheckpoint, UnsupportedManifest
from ckpt.housekeeping import PassFence
from ckpt.late_commits import LATE_PREFIX, OWNER, is_late, withdraw
from ckpt.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardReceipt,
    merge_receipts,
    parse_manifest,
    parse_step_dir,
    step_dir,
)
from ckpt.owner_claims import OWNER_DIR
from ckpt.ownership import OwnerLease
from ckpt.storage import AlreadyCommitted, Storage

log = logging.getLogger(__name__)

QUARANTINED_PREFIX = "manifest.corrupt-"  # a quarantined manifest's name: manifest.corrupt-<ms>-<random>.json
TORN_PREFIX = "manifest.torn-"  # a withdrawn torn write of the committer's, never committed: not quarantined


class RootNotListed(ConnectionError):
    """A listing of a leased root lacked the lease's own directory: the store's answer, not the root's
    contents. A ConnectionError, so readers retry it as a store that did not answer properly."""


def _parses(data: bytes, step: int) -> bool:
    """Whether `data` is a manifest: of this schema, or of another (UnsupportedManifest is no torn write)."""
    try:
        parse_manifest(data, step)
    except CorruptCheckpoint:
        return False
    except UnsupportedManifest:
        pass  # a manifest of another release: whole, and not this code's to move
    return True


class Catalog:
    """The checkpoints of one job under `<checkpoint.url>/<job name>`.

    `owner`: the lease on the root (ckpt.ownership) of the driver, or of `undying ckpt gc`, checked
    before each change this catalog makes to storage (a commit, moving a manifest aside, each step
    a GC or retention pass deletes), which raises OwnershipLost once another claimed the root and
    OwnershipUncertain while the holder's beats do not land; None for readers, which change
    nothing, and for `gc --force`."""

    def __init__(self, storage: Storage, owner: OwnerLease | None = None):
        self.storage = storage
        self.owner = owner
        self.history: set[int] | None = None  # committed steps as the owner claimed (ckpt.late_commits)

    def fence(self) -> None:
        """Raise OwnershipLost unless this catalog's holder still owns the root, OwnershipUncertain while
        its beats have not landed for a lease (ckpt.ownership.OwnerLease.check); a no-op without one."""
        if self.owner is not None:
            self.owner.check()

    def manifest_path(self, step: int) -> str:
        return self.storage.path(step_dir(step), MANIFEST_NAME)

    def commit(
        self, *, job: str, step: int, generation: int, layout: dict, spec_hash: str,
        receipts: list[ShardReceipt], state: dict, files_here: bool = True,
    ) -> Manifest:
        """Create step's manifest from the ranks' receipts. `files_here`: the shard files are under
        this catalog's root, and are checked to be there (False for the memory level, whose shards
        live in the ranks' memory and whose manifests only prove the shards tile every tensor)."""
        tensors = merge_receipts(receipts)
        if files_here:
            self._require_files(step, receipts)
        claim = self.owner_claim()
        if claim is not None:  # which holder committed it (ckpt.late_commits)
            state = {**state, OWNER: claim}
        manifest = Manifest(
            job=job, step=step, generation=generation, layout=layout, spec_hash=spec_hash,
            created_at=time.time(), tensors=tensors, state=state,
            total_bytes=sum(r.nbytes for r in receipts),
        )
        data = manifest.model_dump_json().encode()
        path = self.manifest_path(step)
        self.fence()
        try:
            self.storage.create_exclusive(path, data)
        except AlreadyCommitted:
            # Our own earlier attempt may have landed (retried request): same step and same
            # shard set means the same checkpoint. Anything else is a second writer.
            existing = self.read_manifest(step)
            if is_late(self, step, existing.state):  # a driver that lost the root: aside, and ours goes in
                withdraw(self, step)
                self.fence()
                self.storage.create_exclusive(path, data)
                return manifest
            if existing.tensors != manifest.tensors:
                raise AlreadyCommitted(
                    f"checkpoint step {step} was committed by another writer with different shards"
                ) from None
            return existing
        return manifest

    def _require_files(self, step: int, receipts: list[ShardReceipt]) -> None:
        """Every shard file the receipts name is in the step's directory: a manifest naming a file
        that is not there (deleted under a writer, or never landed) would be a committed checkpoint
        that cannot load. One listing, not a request per shard."""
        present = set(self.storage.listdir(self.storage.path(step_dir(step))))
        missing = sorted({r.file for r in receipts} - present)
        if missing:
            raise IncompleteCheckpoint(f"{len(missing)} shard file(s) of step {step} are not in storage: "
                                       f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")

    def quarantine(self, step: int, unless_it_parses: bool = False) -> str | None:
        """Withdraw committed checkpoint `step`, found corrupt: its manifest moves aside.

        The copy (`manifest.corrupt-<time>-<random>.json`) keeps the evidence; without `manifest.json`
        the step is no longer committed, so the job can commit a fresh save of the same step
        (its shards carry another save tag, ckpt.shards.shard_file_name). Returns the copy's path.
        `unless_it_parses`: the verdict was on the manifest's own bytes, from a single read; they are
        read again, and a manifest that parses this time stays (None): the first read's bytes were
        the store's or the wire's fault (manifests carry no checksum), not the checkpoint's.
        """
        return self._move_aside(step, QUARANTINED_PREFIX, unless_it_parses)

    def withdraw_torn(self, step: int) -> str | None:
        """Move aside the manifest of `step` that a failed commit of ours left torn (it does not parse).

        It was never committed, so it is kept as `manifest.torn-<time>-<random>.json`, which
        `quarantined_steps` does not count: a job whose first save tore reruns without --fresh.
        Returns the copy's path; None when it parses when read again (it landed whole: it stays).
        """
        return self._move_aside(step, TORN_PREFIX, unless_it_parses=True)

    def withdraw_late(self, step: int) -> str | None:
        """Move aside the manifest of `step` that a driver which had lost the root created after this
        owner took it (ckpt.late_commits): `manifest.late-<time>-<random>.json`, kept with its shards as
        evidence (GC leaves the step), not counted by `quarantined_steps`. Returns the copy's path."""
        return self._move_aside(step, LATE_PREFIX, unless_it_parses=False)

    def _move_aside(self, step: int, prefix: str, unless_it_parses: bool) -> str | None:
        self.fence()
        path = self.manifest_path(step)
        data = self.storage.read(path)
        if unless_it_parses and _parses(data, step):
            return None
        # Time for the reader, a random part so two moves in one millisecond never collide.
        name = f"{prefix}{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}.json"
        aside = self.storage.path(step_dir(step), name)
        self.storage.write_immutable(aside, data)
        self.storage.remove(path)
        self.storage.invalidate()
        return aside

    def quarantined_steps(self, prefix: str = QUARANTINED_PREFIX) -> list[int]:
        """Steps without a committed manifest whose committed manifest was quarantined (moved aside as
        corrupt), oldest first. Torn writes withdrawn by the committer (`withdraw_torn`) do not count.
        `prefix` LATE_PREFIX: those whose manifest was a late commit, moved aside (`withdraw_late`)."""
        return [s for s in self.all_steps() if not self.storage.exists(self.manifest_path(s))
                and any(name.startswith(prefix) for name in self.storage.listdir(self.storage.path(step_dir(s))))]

    def read_manifest(self, step: int) -> Manifest:
        """Raises CorruptCheckpoint for bytes that are not a manifest (ckpt.manifest.parse_manifest)."""
        return parse_manifest(self.storage.read(self.manifest_path(step)), step)

    def all_steps(self) -> list[int]:
        """Every step directory, committed or not, oldest first. Under a lease, a listing of the root
        without the lease's own directory raises RootNotListed: the store answered for a root it does
        not show now (a bucket failover, a dropped mount), and read as "no checkpoints" that would
        start the job over from step 0, its retention then deleting the history it could not see."""
        names = self.storage.listdir(self.storage.root)
        if self._leased() and OWNER_DIR not in names:
            raise RootNotListed(f"{self.storage.root} lists without {OWNER_DIR}/, where this process's claim on "
                                "the root lives: the store is not showing the root as it is; nothing is taken "
                                "from that listing")
        steps = (parse_step_dir(name) for name in names)
        return sorted(s for s in steps if s is not None)

    def _leased(self) -> bool:
        """A lease on the root stands behind this catalog's fence (its claim is under the root)."""
        return self.owner_claim() is not None

    def owner_claim(self) -> dict | None:
        """{"epoch", "token"} of the lease behind this catalog's fence; None without one."""
        fence = self.owner.owner if isinstance(self.owner, PassFence) else self.owner
        return {"epoch": fence.epoch, "token": fence.token} if isinstance(fence, OwnerLease) else None

    def gc_candidates(self) -> list[int]:
        """`all_steps`, plus steps that hold only multipart uploads a killed writer left pending (S3)."""
        uploads = (parse_step_dir(name) for name in self.storage.pending_upload_children(self.storage.root))
        return sorted(set(self.all_steps()) | {s for s in uploads if s is not None})

    def committed_steps(self) -> list[int]:
        """Steps with a committed manifest, oldest first."""
        return [s for s in self.all_steps() if self.storage.exists(self.manifest_path(s))]

    def latest(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def gc_plan(self, keep: int, in_flight: Iterable[int] = ()) -> GcPlan:
        """What `apply_gc` would delete now (see `plan_gc`); reads listings only."""
        plan = plan_gc(self.gc_candidates(), self.committed_steps(), keep, in_flight)
        return GcPlan(expired=plan.expired, orphans=self._without_evidence(plan.orphans))

    def _without_evidence(self, orphans: list[int]) -> list[int]:
        """`orphans` less the steps that hold a quarantined or a late commit's manifest: a checkpoint proven
        corrupt, or committed by a driver that had lost the root, keeps its files as evidence (its manifest
        moved aside, its shards as they were) until someone who has examined them deletes them; GC takes
        it for an unfinished save otherwise."""
        return [s for s in orphans if not any(name.startswith((QUARANTINED_PREFIX, LATE_PREFIX)) for name in
                                              self.storage.listdir(self.storage.path(step_dir(s))))]

    def apply_gc(self, plan: GcPlan) -> None:
        """Delete what `plan` names: expired checkpoints first, then orphaned directories. The lease
        is checked before each step's deletion, not once for the pass: a long pass on an object
        store must not go on for a holder replaced while it ran."""
        for step in plan.expired:
            self.fence()
            # Manifest first: from that moment the checkpoint no longer exists for readers,
            # so a crash in the middle leaves only garbage, never a half-deleted checkpoint.
            self.storage.remove(self.manifest_path(step))
            self.storage.remove_tree(self.storage.path(step_dir(step)))
        for step in plan.orphans:
            self.fence()
            # Looked at again just before: a create that stalled in a client's retries (a driver that
            # lost the root meanwhile) may land after the plan was made, and then it is a commit.
            if self.storage.exists(self.manifest_path(step)):
                log.warning("checkpoint gc left step %d: its manifest appeared after the pass was planned", step)
                continue
            self.storage.remove_tree(self.storage.path(step_dir(step)))
        if plan.expired or plan.orphans:
            log.info("checkpoint gc deleted committed steps %s and unfinished saves %s", plan.expired, plan.orphans)

    def apply_retention(self, keep: int, newest: int | None = None, left_behind: Iterable[int] = ()) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints; return the deleted steps.

        `newest`: the running job's newest commit; `left_behind`: committed steps it skipped at its
        restore (unreadable then, not proven bad). Both those and the steps above `newest` are left
        out, kept and not counted: they belong to the history the job left, and counted as the
        newest `keep` they would have retention delete the job's own commits."""
        left = set(left_behind)
        committed = [s for s in self.committed_steps() if (newest is None or s <= newest) and s not in left]
        plan = GcPlan(expired=plan_gc(committed, committed, keep).expired, orphans=[])
        self.apply_gc(plan)
        return plan.expired

    def collect_garbage(self, in_flight: Iterable[int] = (), before: int | None = None) -> list[int]:
        """Remove step directories without a manifest that are older than the newest commit and,
        when given, than `before`: the newest step the running job committed or resumed from.
        Its saves in progress are all newer than that, also when it resumed from a step older
        than the newest commit (which it skipped: unreadable to a rank, or proven bad)."""
        committed = self.committed_steps()
        orphans = plan_gc(self.gc_candidates(), committed, len(committed) or 1, in_flight).orphans
        plan = GcPlan(expired=[], orphans=self._without_evidence([s for s in orphans if before is None or s < before]))
        self.apply_gc(plan)
        return plan.orphans


@dataclass(frozen=True)
class GcPlan:
    expired: list[int]  # committed checkpoints beyond the newest `keep`, oldest first
    orphans: list[int]  # step directories without a manifest, older than the newest commit


def plan_gc(all_steps: Iterable[int], committed: Iterable[int], keep: int, in_flight: Iterable[int] = ()) -> GcPlan:
    """Retention and garbage collection as a pure decision.

    Keeps the newest `keep` committed checkpoints (at least one: the newest committed
    checkpoint is never deleted, whatever `keep` says). An uncommitted step directory is
    garbage only when it is older than the newest commit and not `in_flight`: a newer one
    may be a save whose manifest is about to be committed.
    """
    committed = sorted(set(committed))
    kept = max(1, keep)
    expired = committed[: max(0, len(committed) - kept)]
    if not committed:
        return GcPlan(expired=[], orphans=[])
    done, busy = set(committed), set(in_flight)
    orphans = sorted(s for s in set(all_steps) if s < committed[-1] and s not in done and s not in busy)
    return GcPlan(expired=expired, orphans=orphans)
