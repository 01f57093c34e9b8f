"""Checkpoints of a parameter-server job: each server writes its shard as a rank would, the driver commits.

A server's shard is a list of slices of the same logical tensors a collective job saves
(`model/<name>`, `optim/<name>/<field>`: `ShardServer.state_slices`), so server k writes them
with the checkpoint library's rank writer (`ckpt.shards.write_slices`: one immutable shard file,
the same format, rank k's file name) and the driver commits the manifest with the library's
committer (`ckpt.commit.Committer`: every shard durable and tiling every tensor, then the
manifest created last and exclusively, then retention). Any loader sees server k as rank k: a
PS checkpoint loads into a collective job of the same model, and a collective job's into servers.

Protocol (the driver: paramserver.job's supervisor, or tests with in-process `ShardServer`s):
  * save: at a segment boundary, when every worker has pushed exactly `step` steps (a consistent
    cut: every server holds the state of step `step`), `save_ps_checkpoint(servers, root, step,
    ...)` asks every server at once (`ServerActor.save_shard`), then commits. A server that is
    not at the cut refuses, and nothing is committed.
  * restore: `latest_committed_step(root)`, then `restore_servers(servers, root, step)` (every
    given server at once: `ServerActor.load_shard`, each reading only its own slices' byte ranges
    through the reshard planner), before any worker pulls again.
`root` is the job's checkpoint root (`<checkpoint.url>/<job name>`, the spec's `checkpoint_root`).

Each save writes its shard files under a fresh tag (ckpt.shards.shard_file_name), so a save of a
step that is retried, or tears before its commit, never overwrites a file a committed manifest names.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import RayTaskError

from ckpt.catalog import Catalog
from ckpt.commit import Commit, Committer
from ckpt.config import DEFAULT_READ_RETRY_S
from ckpt.errors import CorruptCheckpoint, location_of
from ckpt.manifest import ShardReceipt
from ckpt.ownership import OwnerLease
from ckpt.reader import read_manifest, read_slices, verify_checkpoint, verify_location
from ckpt.shards import write_slices
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry, storage_failure
from paramserver.partition import param_name
from paramserver.shard import ShardServer, lazy_step_name
from trainer.checkpoint_match import refuse_another_model
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.dtensor_slices import optimizer_fields
from trainer.engine_state import STATE_FORMAT
from trainer.optim import lr_at
from trainer.state_slices import TensorSlice

log = logging.getLogger(__name__)

PS_STATE = "ps"  # the manifest's state key of what only a PS job records


class PSCheckpointError(RuntimeError):
    """A PS save whose shards were written did not commit: not every server's shard is there, they
    do not tile every tensor, or the manifest create failed twice (ckpt.commit.Committer)."""


class ServersTimedOut(PSCheckpointError):
    """Servers did not finish their shard's save or load within the limit (`servers`: their indices):
    hung, or stuck on the store. A save that times out fails (the job goes on); a restore that does
    has those servers replaced (paramserver.restores)."""

    def __init__(self, what: str, servers: list[int], timeout_s: float, setting: str):
        super().__init__(f"{what}: servers {servers} did not finish within {timeout_s:.0f} s ({setting})")
        self.servers = servers


@dataclass(frozen=True)
class PSJob:
    """What the manifest records beyond the shards: the job and its configs (from the spec)."""

    job: str
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig
    spec_hash: str = ""
    keep: int = 3  # checkpoint.keep
    data_identity: dict | None = None  # trainer.data.data_identity: a resume under other data is refused
    # The data's tokenizer and the special token ids (ckpt.hf_export.data_provenance): an export ships them.
    provenance: dict = field(default_factory=dict)


def catalog(root: str, storage_options: dict | None = None, owner: OwnerLease | None = None) -> Catalog:
    return Catalog(Storage(root, dict(storage_options or {})), owner=owner)


def latest_committed_step(root: str, storage_options: dict | None = None, owner: OwnerLease | None = None,
                          read_retry_s: float = DEFAULT_READ_RETRY_S) -> int | None:
    """The newest step with a committed manifest under `root` (a save that tore before its commit
    is not one), or None. With the driver's lease (`owner`), a root the store lists without the lease's
    directory (ckpt.catalog.RootNotListed) is retried as a store that failed, never read as "no
    checkpoint", from which the job would start over at step 0; a store that keeps failing for
    `read_retry_s` raises TransientStorageError."""
    return ReadRetry(read_retry_s).call(catalog(root, storage_options, owner).latest, "listing the committed "
                                                                                      "checkpoints")


def quarantined_steps(root: str, storage_options: dict | None = None, owner: OwnerLease | None = None,
                      read_retry_s: float = DEFAULT_READ_RETRY_S) -> list[int]:
    """The steps under `root` whose manifests were moved aside as corrupt (kept as evidence)."""
    return ReadRetry(read_retry_s).call(catalog(root, storage_options, owner).quarantined_steps,
                                        "listing the quarantined checkpoints")


# ---- one server (called inside its actor, or on an in-process ShardServer) -------------------


def snapshot_shard(server: ShardServer, step: int) -> list[TensorSlice]:
    """The server's state at cut `step` (CPU copies): raises NotAtCut when it is not at that cut."""
    server.check_cut(step)
    return server.state_slices()


def write_shard(server_index: int, slices: list[TensorSlice], root: str, step: int,
                storage_options: dict | None = None, tag: str = "") -> ShardReceipt:
    """Write one server's slices as rank `server_index`'s shard file of `step`; its receipt."""
    storage = Storage(root, dict(storage_options or {}))
    return write_slices(storage, step, server_index, slices, 0.0, tag=tag)


def load_shard(server: ShardServer, root: str, step: int, storage_options: dict | None = None, *,
               clock: int | None = None, read_retry_s: float = DEFAULT_READ_RETRY_S) -> int:
    """Load committed checkpoint `step` (of a PS job or a collective job of the same model) into
    `server`: its parameters (filled in place, only once every block is read and verified), its
    optimizer state and lazy sparse state; returns the version (ShardServer.restore)."""
    cat = catalog(root, storage_options)
    retry = ReadRetry(read_retry_s)
    manifest = read_manifest(cat, step, retry)
    refuse_another_model(manifest.state, server.model.architecture(), step)
    _check_meta(server, manifest.state.get("engine") or {}, step)
    wanted = [w for w in wanted_slices(server) if w.name in manifest.tensors]
    _check_complete(server, wanted, manifest.tensors.keys(), step)
    read = read_slices(cat, step, wanted, manifest=manifest, retry=retry)
    return server.restore({(piece.name, piece.offsets): piece for piece in read}, step, clock)


def wanted_slices(server: ShardServer) -> list[TensorSlice]:
    """Every slice this server's state could be loaded from (each once: the bands of a tensor all
    want its scalar step); the parameters' slices carry the live tensors (the reader fills them in place)."""
    tc = server.train
    fields = optimizer_fields(tc.optimizer, tc.betas)
    out: list[TensorSlice] = []
    for i, (piece, param) in enumerate(zip(server.slices, server.params, strict=True)):
        name = param_name(piece)
        out.append(piece.with_tensor(param.data))
        out.extend(TensorSlice(f"optim/{name}/{f}", piece.dtype, piece.global_shape, piece.offsets, piece.lengths)
                   for f in fields if f != "step")
        out.append(TensorSlice(f"optim/{name}/step", torch.float32, (), (), ()))
        if i in server.sparse:
            out.append(TensorSlice(lazy_step_name(name), torch.int64, piece.global_shape[:1], piece.offsets[:1],
                                   piece.lengths[:1]))
    return list({piece.key: piece for piece in out}.values())


def _check_meta(server: ShardServer, meta: dict, step: int) -> None:
    """What the collective engine checks too (trainer.engine_state): the state format, and the
    settings a resume must not change."""
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"checkpoint step {step} has state format {meta.get('format')!r}, not {STATE_FORMAT!r}")
    for key in ("global_batch", "optimizer"):
        if meta.get(key) != getattr(server.train, key):
            raise ValueError(f"checkpoint step {step} has train.{key} = {meta.get(key)!r}, this job "
                             f"{getattr(server.train, key)!r}: resuming would change the training trajectory; set "
                             f"train.{key} back to {meta.get(key)!r}, or start over under another name")


def _check_complete(server: ShardServer, wanted: list[TensorSlice], stored, step: int) -> None:
    """Every parameter stored; optimizer state all or nothing (a save before the first step has none)."""
    missing = sorted(piece.name for piece in server.slices if piece.name not in stored)
    names = {w.name for w in wanted}
    if any(name.startswith("optim/") for name in names):
        tc = server.train
        missing += sorted({f"optim/{param_name(p)}/{f}" for p in server.slices
                           for f in optimizer_fields(tc.optimizer, tc.betas)} - names)
    if missing:
        raise ValueError(f"checkpoint step {step} does not hold server {server.index}'s state: missing "
                         f"{missing[:5]}{' and more' if len(missing) > 5 else ''}; is it a checkpoint of this model "
                         "and optimizer?")


# ---- the driver ------------------------------------------------------------------------------


def _call(servers: list, method: str, *args, timeout: tuple[float, str, str] | None = None, **kwargs) -> list:
    """`method` on every server at once: ServerActor handles through Ray, in-process ShardServers
    (tests, paramserver.lockstep) one after the other through this module's functions. `timeout`:
    (seconds, the setting that gave them, what the call is), ServersTimedOut past it."""
    if all(isinstance(s, ShardServer) for s in servers):
        local = {"save_shard": _save_local, "load_shard": load_shard}[method]
        return [local(s, *args, **kwargs) for s in servers]
    refs = [getattr(s, method).remote(*args, **kwargs) for s in servers]
    if timeout is not None:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout[0])
        if len(done) < len(refs):
            late = [k for k, ref in enumerate(refs) if ref not in done]
            raise ServersTimedOut(timeout[2], late, timeout[0], timeout[1])
    return ray.get(refs)


def _save_local(server: ShardServer, root: str, step: int, storage_options: dict | None = None,
                tag: str = "") -> ShardReceipt:
    return write_shard(server.index, snapshot_shard(server, step), root, step, storage_options, tag)


def engine_meta(step: int, job: PSJob) -> dict:
    """The manifest's `engine` state in the collective engine's format (trainer.engine_state): the
    cursor (next step) and what a collective load checks (data seed and identity, global batch,
    optimizer); `undying run` checks them too before it resumes (orchestrator.cli.resume_check)."""
    tc, par = job.train, job.parallel
    return {"format": STATE_FORMAT, "next_step": step, "data_seed": job.data.seed, "train_seed": tc.seed,
            "global_batch": tc.global_batch, "optimizer": tc.optimizer, "lr": lr_at(step, tc), "scaler": None,
            "layout": {"dp": par.dp, "dp_replicate": 1, "tp": 1, "pp": 1, "zero": 0, "micro_batch": tc.micro_batch,
                       "world_size": par.servers}, **({"data": job.data_identity} if job.data_identity else {})}


def save_ps_checkpoint(servers: list, root: str, step: int, *, job: PSJob, storage_options: dict | None = None,
                       fault_point=None, owner: OwnerLease | None = None, state: dict | None = None,
                       timeout: tuple[float, str] | None = None, skipped: set[int] = frozenset(),
                       unsure: set[int] | None = None) -> Commit | None:
    """Write checkpoint `step` of every server (all at the cut `step`) and commit it; the Commit, or
    None when `step` is committed already (nothing is written). A server's error is raised as it
    came (NotAtCut: not at the cut; a storage error; a dead actor's), PSCheckpointError when the
    written shards did not commit; either way no earlier checkpoint is touched and what was
    written is garbage the next commit collects. `fault_point(point, step)`: the committer's chaos
    points ("before_manifest_commit", "after_manifest_commit"). `owner`: the driver's lease on `root`
    (ckpt.ownership), checked before the commit and before retention (OwnershipLost). `state`: more of
    the manifest's state (the goodput ledger's totals, which a resumed job carries on). `timeout`:
    (seconds, the setting that gave them) for the servers' writes, ServersTimedOut past it.
    `skipped`: the commits this run's restores skipped (unreadable then, not proven bad), which
    retention neither counts nor deletes, as in a collective job; a step among them is not saved
    (PSCheckpointError). `unsure`: the run's steps whose manifest create failed with the store's
    errors (a stalled request may still land): no save's garbage collection takes their shards,
    and a create of this save failing so is added."""
    if step in skipped:  # committed by an earlier run; this run's state there cannot be saved
        raise PSCheckpointError(f"step {step} is committed by an earlier run, which a server could not read: "
                                "this run's state there is not saved")
    cat = catalog(root, storage_options, owner)
    try:
        if step in cat.committed_steps():
            return None
        cat.fence()  # no shard of a driver that lost the root lands in it
    except Exception as err:  # the store (RootNotListed, OwnershipUncertain among its answers): this save fails
        if not storage_failure(err):
            raise  # OwnershipLost among them: the job ends
        raise PSCheckpointError(f"checkpoint step {step} was not committed: the checkpoints could not be listed, or "
                                f"the owner lease checked ({type(err).__name__}: {err})") from err
    tag = f"ps{secrets.token_hex(4)}"
    try:
        receipts = _call(servers, "save_shard", root, step, storage_options, tag,
                         timeout=timeout and (*timeout, f"checkpoint step {step} was not committed"))
    except RayTaskError as err:  # a server's own error writing its shard: this save fails, the job goes on
        cause = getattr(err, "cause", None) or err
        if not storage_failure(cause):
            raise
        raise PSCheckpointError(f"checkpoint step {step} was not committed: a server could not write its shard "
                                f"({type(cause).__name__}: {cause})") from err
    if sorted(r.rank for r in receipts) != list(range(job.parallel.servers)):
        raise PSCheckpointError(f"checkpoint step {step} was not committed: it has the shards of servers "
                                f"{sorted(r.rank for r in receipts)}, the job has {job.parallel.servers}")
    return _commit(cat, receipts, step, job, state, fault_point, skipped, unsure)


def _commit(cat: Catalog, receipts: list[ShardReceipt], step: int, job: PSJob, state: dict | None, fault_point,
            skipped: set[int], unsure: set[int] | None) -> Commit:
    """save_ps_checkpoint's commit of every server's written shard (ckpt.commit.Committer)."""
    dropped: list[str] = []
    committer = Committer(cat, job.job, job.spec_hash, job.keep, fault_point=fault_point,
                          on_dropped=lambda s, reason: dropped.append(reason))
    committer.left_behind = set(skipped)
    if unsure is not None:
        committer.unsure = unsure  # the run's, shared: a later save's GC must not take a stalled create's shards
    par, servers = job.parallel, len(receipts)
    layout = {"mode": "ps", "servers": servers, "dp": par.dp, "world_size": servers}
    ps = {"servers": servers, "workers": par.dp, "consistency": par.consistency, "staleness": par.staleness}
    extra = {**(state or {}), "model": job.model.architecture(), "seq_len": job.data.seq_len, PS_STATE: ps,
             **job.provenance}
    commit = None
    for receipt in receipts:
        commit = committer.on_receipt(receipt, {"engine": engine_meta(step, job)}, servers, 0, layout,
                                      lambda samples: extra)
    if commit is None:
        raise PSCheckpointError(f"checkpoint step {step} was not committed: {'; '.join(dropped) or 'unknown'}")
    return commit


def restore_servers(servers: list, root: str, step: int, *, storage_options: dict | None = None,
                    clock: int | None = None, read_retry_s: float = DEFAULT_READ_RETRY_S,
                    timeout: tuple[float, str] | None = None) -> list[int]:
    """Load committed checkpoint `step` into every given server at once; their versions. `timeout`:
    (seconds, the setting that gave them), ServersTimedOut past it."""
    return _call(servers, "load_shard", root, step, storage_options, clock=clock, read_retry_s=read_retry_s,
                 timeout=timeout and (*timeout, f"the restore of checkpoint step {step}"))


def restore_newest_intact(servers: list, root: str, step: int, *, storage_options: dict | None = None,
                          read_retry_s: float = DEFAULT_READ_RETRY_S, owner: OwnerLease | None = None,
                          skipped: set[int] | None = None, timeout: tuple[float, str] | None = None) -> int:
    """Restore committed `step` into every server; when a server's read proves it corrupt
    (CorruptCheckpoint), check it here as a collective job's controller does: bytes that are bad here
    too are proof, and the checkpoint is quarantined (its manifest moved aside under the lease
    `owner`, its files kept as evidence); bytes that read intact here (a server's stale view of the
    store, a read damaged in flight) leave it committed, added to `skipped` (the caller's, for the
    run: never restored again, paramserver.supervisor). Either way every server restores the next
    older commit not skipped. The step restored; PSCheckpointError when none is left: the job never
    starts over from step 0 on its own. A server loads a step only once every block verified, and a
    fall back restores every server, so no server keeps another step's state. `timeout`: as
    restore_servers' (ServersTimedOut is the caller's to repair)."""
    proven, stuck, skipped = [], [], set() if skipped is None else skipped  # stuck: proven, not moved aside
    cat = None  # made at the first fall back: a restore that succeeds lists nothing
    while True:
        if step not in skipped:
            try:
                restore_servers(servers, root, step, storage_options=storage_options, read_retry_s=read_retry_s,
                                timeout=timeout)
                return step
            except CorruptCheckpoint as err:  # (through Ray: a RayTaskError that is an instance of its cause)
                cat = cat or catalog(root, storage_options, owner)
                if not _proven_here(cat, step, err, read_retry_s):
                    log.error("checkpoint step %d failed a server's read (%s) but not here: kept committed, skipped "
                              "by this run; restoring the next older commit", step, err)
                    skipped.add(step)
                elif _quarantined(cat, step):
                    log.error("CHECKPOINT STEP %d IS CORRUPT (%s): quarantined; restoring the next older commit",
                              step, err)
                    proven.append(step)
                else:  # proven, but the store failed the quarantine: kept, and skipped as unreadable
                    skipped.add(step)
                    stuck.append(step)
        cat = cat or catalog(root, storage_options, owner)
        listed = ReadRetry(read_retry_s).call(cat.committed_steps, "listing the committed checkpoints")
        older = [s for s in listed if s < step and s not in skipped]
        if not older:
            unread = sorted(skipped - set(stuck))
            raise PSCheckpointError(f"no committed checkpoint left to restore: steps {proven} proved corrupt "
                                    f"(quarantined as evidence), steps {stuck} proved corrupt but the store failed "
                                    f"to move them aside (kept), steps {unread} failed the servers' reads only "
                                    "(kept); " + ("rerun once every node reads the store" if unread else
                                                  "`undying run --fresh` starts the job over from step 0"))
        step = older[-1]


def _quarantined(cat: Catalog, step: int) -> bool:
    """Move proven-corrupt `step`'s manifest aside; False, logged, when the store fails the move (the
    step then stays committed, skipped by the run as one a server could not read)."""
    try:
        cat.quarantine(step)
        return True
    except Exception as err:  # noqa: BLE001 (re-raised unless the store's)
        if not storage_failure(err):
            raise
        log.error("checkpoint step %d is corrupt but its quarantine failed (%s: %s): kept committed, skipped by "
                  "this run", step, type(err).__name__, err)
        return False


def _proven_here(cat: Catalog, step: int, err: CorruptCheckpoint, read_retry_s: float) -> bool:
    """Whether the driver's own read proves `step` corrupt: of the bytes the server's error names
    (`location`), else of the whole checkpoint. A store that keeps failing proves nothing."""
    location = location_of(err)
    try:
        if location is None:
            verify_checkpoint(cat, step, ReadRetry(read_retry_s))
        else:
            verify_location(cat, step, location, ReadRetry(read_retry_s))
    except CorruptCheckpoint:
        return True
    except Exception as e:  # noqa: BLE001 (the store's errors, transient or not: no proof either way)
        log.warning("checkpoint step %d could not be checked here (%s): kept committed", step, e)
    return False
