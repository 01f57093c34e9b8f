"""The controller's side of the memory level: snapshot cadence, completion, and the level a restore uses.

Protocol (controller thread only; owned by orchestrator.controller.checkpoints.Checkpoints):
  * `begin(gen, anchor)` when a generation restored (snapshots start afresh); `every(step_times)`
    gives the cadence the plan publishes (`CheckpointPlan.memory_every`; None while the level is off).
  * `on_held(message, world_size, gen, layout, extra_state)` for each `SnapshotHeld`: when every
    rank's shard is in, and each is held by two processes (the owner and its buddy), the snapshot
    is complete; the newest complete one replaces the previous (its manifest, built and checked
    by the same committer as a storage commit, lives in this process's memory).
  * `choose(storage_step, live, held)` in RESTORING: the newest complete snapshot when it is at least
    as new as the newest committed storage checkpoint and every shard of it has a holder among
    `live` (actor id -> handle) that still holds it (`held`: what each holds, asked as the ranks
    left: a holder prunes a snapshot that completed after its owner took a newer one); else None,
    and a snapshot that lost shards is named loudly.
  * `discard(step, err)` when a restore from it failed (a holder died meanwhile): never chosen again;
    `on_storage_restore()` when a restore from storage is issued (the ranks drop every snapshot).
  * `buddies(workers, world_size)` at each generation's start: which rank keeps whose copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.manifest import step_dir
from ckpt.storage import Storage
from orchestrator.cluster.buddies import choose_buddies, survives_any_node_loss
from orchestrator.controller.policies import CheckpointIntervalPolicy
from orchestrator.rank.snapshots import MemorySource
from orchestrator.spec.job_spec import spec_hash
from orchestrator.wire.messages import SnapshotHeld

MAX_PENDING = 3  # snapshot steps waiting for their last shards; older ones can no longer complete usefully


@dataclass
class Snapshot:
    """A complete memory snapshot: every shard held by two processes."""

    step: int
    manifest_json: str
    holders: dict[str, list[str]]  # shard file -> actor ids, owner first
    samples: dict[int, list[int]] = field(default_factory=dict)  # rank -> sample digest (as in a commit)
    completed_at: float = 0.0


class MemoryLevel:
    def __init__(self, spec, run_id: str, storage_policy: CheckpointIntervalPolicy, log: Callable[[str], None]):
        self.enabled = spec.checkpoint.memory.enabled
        self.log = log
        self.job, self.hash, self.root = spec.name, spec_hash(spec), f"memory://undying-snapshots/{spec.name}-{run_id}"
        self.committer = self._committer(0)
        self.policy = CheckpointIntervalPolicy(spec.checkpoint.memory_cadence())
        self.policy.inputs.mtbf = storage_policy.inputs.mtbf  # one MTBF estimate: failures are counted once
        self.newest: Snapshot | None = None
        self.unusable: set[int] = set()
        self._holders: dict[int, dict[str, list[str]]] = {}  # step -> file -> actor ids, while pending
        self.held_bytes: dict[int, int] = {}  # rank -> host bytes its memory level holds (last report)
        self.last_blocking_s: float | None = None
        self.warned_one_node = False
        self.incomplete = 0  # snapshots given up: they never had every shard held twice

    def buddies(self, workers, world_size: int) -> dict:
        """`start_training`'s keyword for the memory level: {"buddies": rank -> buddy rank}, {} when off."""
        if not self.enabled:
            return {}
        nodes = [workers.node_of(rank) for rank in range(world_size)]
        buddies = choose_buddies(nodes)
        if world_size > 1 and not survives_any_node_loss(nodes, buddies) and not self.warned_one_node:
            self.warned_one_node = True
            self.log("memory snapshots: the ranks share one node, so a buddy's copy survives a rank's death but "
                     "not the node's (storage checkpoints cover that)")
        return {"buddies": dict(enumerate(buddies))}

    def _committer(self, gen: int) -> Committer:
        # The manifests go to this process's memory: the committer checks that the shards tile
        # every tensor exactly, as for a storage commit, and writes nothing durable (the shards are in
        # the ranks' memory, not under this root: files_here=False). One root per
        # generation: a restore to an older step must not find the lost steps' manifests newer than
        # its own (retention would delete each new snapshot at once).
        return Committer(Catalog(Storage(f"{self.root}/g{gen}")), self.job, self.hash, keep=1, files_here=False)

    def begin(self, gen: int, anchor: int | None, from_memory: bool = False) -> None:
        """A generation restored `anchor`: snapshots start afresh; a complete one survives only if it
        is the one restored (it stays the newest state until this generation completes another). A
        restore from storage keeps none, even of the same step: the ranks dropped what they held."""
        old = self.committer.catalog.storage
        old.remove_tree(old.root)
        self.committer = self._committer(gen)
        self.committer.reset(anchor)
        self._holders.clear()
        self.held_bytes.clear()  # by rank: a shrink renumbered them, and every rank reports again
        if self.newest is not None and (self.newest.step != anchor or not from_memory):
            self.newest = None

    def every(self, step_times_s: list[float]) -> int | None:
        return self.policy.every(step_times_s) if self.enabled else None

    def on_held(self, message: SnapshotHeld, world_size: int, gen: int, layout: dict,
                extra_state: Callable[[dict], dict]) -> Snapshot | None:
        """One rank's snapshot shard; the Snapshot when it completed one."""
        receipt, extra = message.receipt, dict(message.extra)
        self.held_bytes[receipt.rank] = int(extra.pop("held_bytes", 0))
        if world_size > 1 and len(set(message.holders)) < 2:
            return None  # a shard held once is not a complete snapshot
        if receipt.step in self.committer.abandoned:
            return None  # a late shard of a snapshot given up (`_give_up_stale`)
        self._holders.setdefault(receipt.step, {})[receipt.file] = list(message.holders)
        self._give_up_stale()
        commit = self.committer.on_receipt(receipt, extra, world_size, gen, layout, extra_state)
        if commit is None:
            return None
        self.unusable.discard(commit.step)  # a new snapshot of a step whose earlier one was lost
        manifest = self.committer.catalog.read_manifest(commit.step)
        self.newest = Snapshot(commit.step, manifest.model_dump_json(), self._holders.pop(commit.step),
                               commit.samples, time.time())
        for step in [s for s in self._holders if s < commit.step]:
            del self._holders[step]
        self.last_blocking_s = commit.blocking_s  # the caller feeds the policy the whole cost
        return self.newest

    def _give_up_stale(self) -> None:
        """Snapshots that never completed (a rank whose buddy copy keeps failing: its shard is never
        held twice) would wait for their last shard, receipts and all, for the whole generation: past
        MAX_PENDING the oldest are given up, counted in `incomplete`."""
        for step in sorted(self._holders)[:-MAX_PENDING]:
            del self._holders[step]
            self.committer.abandon(step, "newer snapshots were taken while it still missed shards held twice")
            self.incomplete += 1
            if str(self.incomplete).strip("0") == "1":  # the 1st, 10th, 100th...: said, not every time
                self.log(f"memory snapshot of step {step} never completed (a shard not held twice: see the "
                         f"ranks' warnings); {self.incomplete} given up so far, restores use the newest complete "
                         "one or storage")

    def worth_asking(self, storage_step: int | None) -> bool:
        """Whether a snapshot could be chosen over `storage_step`, so that its holders are worth asking."""
        return self._candidate(storage_step) is not None

    def newest_step(self) -> int | None:
        """The newest complete snapshot's step (the plan names it: ckpt.held keeps it), None without one."""
        return self.newest.step if self.newest is not None else None

    def _candidate(self, storage_step: int | None) -> Snapshot | None:
        snap = self.newest
        if not self.enabled or snap is None or snap.step in self.unusable:
            return None
        return None if storage_step is not None and snap.step < storage_step else snap

    def viable(self, storage_step: int | None, live: dict, held: dict | None = None) -> bool:
        """Whether `choose` would pick the newest snapshot (no side effects)."""
        snap = self._candidate(storage_step)
        return snap is not None and all(self._holding(snap, file, live, held) for file in snap.holders)

    @staticmethod
    def _holding(snap: Snapshot, file: str, live: dict, held: dict | None) -> list:
        """The handles of `file`'s holders that are alive and still hold it, as far as `held` says (a
        holder it leaves out did not answer in time: alive is all that is known of it)."""
        relpath = f"{step_dir(snap.step)}/{file}"
        return [live[h] for h in snap.holders[file]
                if h in live and (held is None or h not in held or relpath in held[h])]

    def samples_of(self, step: int) -> dict[int, list[int]]:
        return self.newest.samples if self.newest is not None and self.newest.step == step else {}

    def choose(self, storage_step: int | None, live: dict, held: dict | None = None) -> MemorySource | None:
        """`held` (actor id -> the files it holds, asked just now; None: not asked): a holder that pruned
        a shard (its owner took a newer snapshot before this one completed) does not count for it."""
        snap = self._candidate(storage_step)
        if snap is None:
            return None
        holders = {file: self._holding(snap, file, live, held) for file in snap.holders}
        lost = sorted(file for file, found in holders.items() if not found)
        if lost:
            self.unusable.add(snap.step)
            self.log(f"memory snapshot of step {snap.step} LOST: no live holder of {len(lost)} of its "
                     f"{len(holders)} shards (owner and buddy both gone, or pruned by them: {', '.join(lost[:4])}); "
                     "restoring from storage" + (f" step {storage_step}" if storage_step is not None
                                                  else " (nothing committed)"))
            return None
        return MemorySource(snap.step, snap.manifest_json, holders)

    def forget_newer(self, step: int) -> None:
        """A generation stopped on purpose to re-form at commit `step` (growing back) throws away the steps
        past it, booked as lost work: a snapshot newer than it is not restored later (a re-formation that
        fails to form and recovers) as if they had been kept."""
        if self.newest is not None and self.newest.step > step:
            self.newest = None

    def on_storage_restore(self) -> None:
        """A restore from storage is issued: every rank drops what it holds as it begins
        (orchestrator.rank.actor: `keep_only`), so no snapshot outlives it, not even one of the
        restored step, should that restore fail and the recovery after it look for one."""
        self.newest = None

    def discard(self, step: int, err: BaseException) -> str:
        self.unusable.add(step)
        return (f"memory snapshot of step {step} could not be restored ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:200]}); restoring from storage instead")
