"""Glue between a rank's engine and the checkpoint library: build, save-set, restore.

Called on a rank only (inside `RankActor`). Replicated data-parallel state is written once
across the ranks (`ckpt.shards.owned_by`), and read back whole by every rank.
"""

from __future__ import annotations

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.shards import owned_by
from ckpt.storage import Storage


def catalog_for(spec) -> Catalog:
    return Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))


def build_engine(spec, rank: int, world_size: int, dp: int, fault_hook=None):
    """The engine for this generation's layout: the spec's, with the current (elastic) dp."""
    from trainer.engine import Engine

    device = "cuda" if spec.resources.gpus_per_rank > 0 else "cpu"
    parallel = spec.parallel.model_copy(update={"dp": dp})
    return Engine(
        spec.model, spec.data, spec.train, parallel,
        rank=rank, world_size=world_size, device=device, fault_hook=fault_hook,
    )


def tensors_to_save(engine, rank: int, world_size: int) -> dict:
    """The subset of the engine's (replicated) state that this rank writes."""
    state = engine.state_tensors()
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    mine = owned_by(rank, world_size, sizes)
    return {name: state[name] for name in mine}


def load_engine_state(spec, engine, step: int) -> dict:
    """Load committed checkpoint `step` into `engine`; returns the manifest's non-tensor state."""
    tensors, manifest = load_checkpoint(catalog_for(spec), step)
    engine_tensors = {k: v for k, v in tensors.items()}
    engine.load_state(engine_tensors, manifest.state["engine"])
    return manifest.state
