"""Small checkpoints for the checkpoint tests: a state of every dtype, saved by several ranks
through the real writer and committed through the real catalog, and a storage-agnostic way
to damage a committed shard."""

from __future__ import annotations

import torch

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.shards import owned_by, write_shard, write_slices
from trainer.state_slices import whole


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(8, 4, generator=g),
        "model/b": torch.randn(4, generator=g),
        "model/half": torch.randn(5, generator=g).to(torch.bfloat16),
        "model/emb.weight": torch.randn(3, 2, 2, generator=g).to(torch.float16),
        "optim/w/step": torch.tensor(3.0),
        "optim/w/exp_avg": torch.randn(8, 4, generator=g),
        "ids": torch.arange(7, dtype=torch.int64),
    }


def save_checkpoint(catalog: Catalog, step: int, state: dict[str, torch.Tensor], world: int = 3,
                    spec_hash: str = "h") -> None:
    """Every rank writes its shard, then the controller commits (as a job of spec `spec_hash` does)."""
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    receipts = []
    for rank in range(world):
        mine = {n: state[n] for n in owned_by(rank, world, sizes)}
        receipts.append(write_shard(catalog.storage, step, rank, mine, blocking_s=0.0))
    catalog.commit(job="j", step=step, generation=0, layout={"dp": world, "tp": 1, "pp": 1, "zero": 0},
                   spec_hash=spec_hash, receipts=receipts, state={"engine": {"next_step": step}})


def shard_receipts(catalog: Catalog, step: int, state: dict[str, torch.Tensor], world: int = 2, tag: str = "") -> list:
    """Every rank's shard of `state` written for `step` (each tensor by one rank), and their
    receipts; `tag` names the files as a save attempt's own (ranks name theirs with the run and
    generation, so a save never overwrites a committed step's files)."""
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    return [write_slices(catalog.storage, step, rank, [whole(n, state[n]) for n in owned_by(rank, world, sizes)],
                         0.0, tag=tag) for rank in range(world)]


def feed(committer, receipts: list):
    """Hand `receipts` to `committer` as the controller does (rank 0's with the engine state); the
    Commit the last one completed, or None. A committer with a commit lane is waited for and
    collected, as the controller's next drain would."""
    out = None
    for r in receipts:
        extra = {"engine": {"next_step": r.step}} if r.rank == 0 else {}
        out = committer.on_receipt(r, extra, len(receipts), 1, {}, lambda samples: {}) or out
    if committer.lane is not None:
        assert committer.flush(10)
        out = next(reversed(committer.collect()), out)
    return out


def shard_path(catalog: Catalog, step: int, file: str) -> str:
    return catalog.storage.path(step_dir(step), file)


def shard_of(catalog: Catalog, step: int, tensor: str) -> str:
    """The shard file that holds (the first chunk of) `tensor` in committed checkpoint `step`."""
    return catalog.read_manifest(step).tensors[tensor].chunks[0].file


def flip_bit(catalog: Catalog, step: int, file: str, offset: int = 3) -> None:
    """Flip one bit of a committed shard in place, on any storage (a silent media error)."""
    path = shard_path(catalog, step, file)
    data = bytearray(catalog.storage.read(path))
    data[offset] ^= 0x40
    catalog.storage.fs.pipe_file(path, bytes(data))
    catalog.storage.invalidate()


def tiny_engine():
    """The single-process tiny-GPT engine the rank-glue tests save and restore."""
    from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from trainer.engine import Engine

    train = TrainConfig(steps=4, global_batch=4, micro_batch=2, lr=1e-3)
    return Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=16), train, ParallelConfig(), rank=0, world_size=1)


def commit_trained_engine(root: str, steps: int = 2, model: dict | None = None):
    """Train `tiny_engine()` for `steps` steps, save it through the real writer and commit it at
    that step under `root` (a file:// job root), its manifest saying the model is `model` (default:
    the engine's own architecture). Returns (the spec stand-in that orchestrator.rank.state reads,
    the trained engine)."""
    from types import SimpleNamespace

    from ckpt.writer import ShardWriter
    from orchestrator.rank.state import catalog_for
    from trainer.config import ModelConfig

    spec = SimpleNamespace(checkpoint_root=root, checkpoint=SimpleNamespace(storage_options={}, read_retry_s=0.0),
                           model=ModelConfig(preset="tiny"))  # tiny_engine()'s
    catalog = catalog_for(spec)
    source = tiny_engine()
    for _ in range(steps):
        source.train_step()
    receipts = []
    ShardWriter(catalog.storage, 0, lambda r, extra: receipts.append(r), lambda s, e: None,
                async_save=False).save(steps, source.state_slices(), {})
    catalog.commit(job="j", step=steps, generation=0, layout={}, spec_hash="h", receipts=receipts,
                   state={"engine": source.state_meta(), "model": model or source.model_config.architecture()})
    return spec, source
