"""Glue between a rank's engine and the checkpoint library: build, save-set, restore.

Called on a rank only (inside `RankActor`). A save hands `engine.state_slices()` to the
rank's `ckpt.writer.ShardWriter`, which writes this rank's share (replicated slices once
across their replicas). A restore reads, from whatever layout wrote the checkpoint, exactly
the slices this rank's layout needs (`engine.wanted_slices()`), and loads them; no
collectives, no other rank involved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ckpt.catalog import Catalog
from ckpt.reader import read_manifest, read_slices
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry, data_read_retry
from trainer.checkpoint_match import refuse_another_model
from trainer.state_slices import TensorSlice


def catalog_for(spec) -> Catalog:
    return Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))


def generation_mesh(spec, world_size: int, collective_timeout_s: float | None = None):
    """The DeviceMesh of a generation of `world_size` ranks (its dp: world_size / (tp x pp)); None for
    one rank. Collective: the rank actor builds it once, at its join, inside the group's socket capture,
    and every restore of the generation builds its engine on it. Built per restore instead, a restore
    retried after a peer's failed one (the stale one built the mesh on some ranks only) left the ranks
    with different counts of sub-groups, whose next ones then waited for each other until the timeout."""
    if world_size == 1:
        return None
    from trainer.topology import Topology, build_mesh

    parallel = spec.parallel.with_dp(world_size // (spec.parallel.tp * spec.parallel.pp))
    return build_mesh(Topology.of(parallel), _device(spec), collective_timeout_s)


def _device(spec) -> str:
    return "cuda" if spec.resources.gpus_per_rank > 0 else "cpu"


def build_engine(spec, rank: int, world_size: int, dp: int, fault_hook=None,
                 recording_groups=contextlib.nullcontext, collective_timeout_s: float | None = None, mesh=None):
    """The engine for this generation's layout: the spec's, with the current (elastic) dp, on `mesh`
    (`generation_mesh`'s) when given. Else its process groups (the DeviceMesh) are created here, inside
    `recording_groups()`, the rank's `CommSockets.adding`, so that an abort reaches their sockets too,
    with the generation's `collective_timeout_s` (elastic.collective_timeout_s) as the default group has it."""
    from trainer.engine import Engine

    parallel = spec.parallel.with_dp(dp)
    if mesh is None and world_size > 1:
        with recording_groups():
            mesh = generation_mesh(spec, world_size, collective_timeout_s)
    device = _device(spec)
    return Engine(
        spec.model, spec.data, spec.train, parallel,
        rank=rank, world_size=world_size, device=device, fault_hook=fault_hook, mesh=mesh,
        read_retry=data_read_retry(spec.data),
    )



def into_live(engine, wanted: Callable[[str], bool]) -> list[TensorSlice]:
    """`engine`'s wanted slices whose names `wanted` takes, each parameter's carrying the rank's live
    tensor: the reader fills it in place (ckpt.reader.assemble, cast to its dtype) once every block
    it needs is read and verified, so no second copy of the rank's share of the model is made while
    the fetched bytes are held. Optimizer state, not built before the first step, is assembled apart."""
    live = {piece.name: piece.tensor for piece in engine.state_slices(copy=False) if piece.name.startswith("model/")}
    return [piece.with_tensor(live.get(piece.name)) for piece in engine.wanted_slices() if wanted(piece.name)]


def load_pretrained(spec, engine, on_bytes=None, interrupt=None) -> None:
    """Load `model.from_hf`'s weights into a fresh engine (a job with nothing committed yet). The
    store's transient failures may take `checkpoint.read_retry_s` (`interrupt` as load_engine_state's).

    Straight into the shards: each wanted slice carries the rank's own live tensor, which the
    reader fills in place (cast to fp32), so no second copy of the rank's share is made; only
    the fetched bytes of its slices are held beside it while they are copied in."""
    from ckpt.hf_import import read_hf_slices

    wanted = into_live(engine, lambda name: name.startswith("model/"))
    retry, model = ReadRetry(spec.checkpoint.read_retry_s, interrupt=interrupt), spec.model
    engine.load_weights(read_hf_slices(model.from_hf, wanted, model, storage_options=model.storage_options,
                                       retry=retry, on_bytes=on_bytes))


def restore_storage_setup(spec, faults, rank: int, notify):
    """This rank's storage faults with `op: read`, as a `storage_setup` for `load_engine_state`
    (None without any): they disturb the restore's reads, and each firing is reported through
    `notify(event)` with the rank, as the writer's storage faults are."""
    from chaos.config import as_armed, rank_storage_faults
    from chaos.storage_faults import install

    mine = rank_storage_faults([as_armed(f, i) for i, f in enumerate(faults or [])], rank, restore=True)
    if not mine:
        return None
    return lambda storage: install(storage, mine, seed=spec.chaos.seed,
                                   notify=lambda event: notify(dict(event, rank=rank)))


def load_engine_state(spec, engine, step: int, fault_hook=None, storage_setup=None, on_bytes=None,
                      interrupt=None) -> dict:
    """Load committed checkpoint `step` into `engine`; returns the manifest's non-tensor state.

    `fault_hook(point, step)`, if given, is called at the chaos point "during_restore": the slices
    are read (the parameters into their live tensors: `into_live`) and not yet loaded (the step,
    the optimizer state), so a fault there leaves a half-restored rank. `storage_setup(storage)`,
    if given, is run on the Storage the reads go through (chaos: this rank's `op: read` faults).
    `on_bytes(n, total)` follows the reads (rank 0 prints its progress: monitor.progress);
    `interrupt()`, called between a failing read's retries, may raise to give the restore up.

    Reads the store fails transiently are retried; its failures may take `checkpoint.read_retry_s`
    of this restore in all (one budget for the manifest and every piece). Raises
    ckpt.errors.CorruptCheckpoint when the checkpoint cannot be read back intact (the controller
    then falls back to the previous committed one), TransientStorageError when the store kept
    failing (the controller then fails the job, deleting nothing).
    """
    catalog = catalog_for(spec)
    if storage_setup is not None:
        storage_setup(catalog.storage)
    retry = ReadRetry(spec.checkpoint.read_retry_s, interrupt=interrupt)  # this restore's one budget
    manifest = read_manifest(catalog, step, retry)
    refuse_another_model(manifest.state, spec.model.architecture(), step)
    # Tensors the checkpoint lacks are left out, and the engine judges: a save taken before the
    # first step has no optimizer state (fine), a missing parameter is an error it names.
    wanted = into_live(engine, lambda name: name in manifest.tensors)
    slices = read_slices(catalog, step, wanted, manifest=manifest, retry=retry, on_bytes=on_bytes)
    if fault_hook is not None:
        fault_hook("during_restore", step)
    engine.load_slices(slices, manifest.state["engine"])
    return manifest.state


def load_from_memory(engine, source, held, on_bytes=None, check=lambda: None, fault_hook=None) -> dict:
    """Load memory snapshot `source` (orchestrator.rank.snapshots.MemorySource) into `engine`: the
    same plan, checks and assembly as a storage restore (any layout), with the bytes read from this
    process's `held` shards where it has them and from the snapshot's live holders otherwise
    (ckpt.peer_storage); `fault_hook` as for `load_engine_state` (chaos's during_restore, after the
    reads). Raises ckpt.errors.SnapshotUnavailable when no holder of some shard answers; returns the
    snapshot's non-tensor state."""
    from ckpt.peer_storage import PeerStorage
    from orchestrator.rank.snapshots import read_from_holder

    manifest = source.manifest()
    # `check` (the restore's staleness) also inside a read's wait: a slow holder must not keep the turn
    storage = PeerStorage(held, source.holders, lambda holder, path, start, end: read_from_holder(
        holder, path, start, end, check))
    wanted = into_live(engine, lambda name: name in manifest.tensors)
    slices = read_slices(Catalog(storage), source.step, wanted, manifest=manifest, retry=ReadRetry(0.0),
                         on_bytes=on_bytes)
    if fault_hook is not None:
        fault_hook("during_restore", source.step)
    engine.load_slices(slices, manifest.state["engine"])
    return manifest.state
