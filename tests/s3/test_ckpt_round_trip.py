"""The checkpoint acceptance round trip, on file://, memory:// and a real S3 server (SeaweedFS).

Eight gloo ranks train a tiny model at dp2 x tp2 x pp2 with ZeRO-3 (1F1B) and, before step
`SAVE_AT`, save through the real `ShardWriter` (staged, written in the background while
training goes on) to every backend; the test commits each manifest with `Catalog.commit`,
as the controller does. Then, with the real reader (`read_slices` of the engine's
`wanted_slices()`, then `load_slices`):
  * dp4 with ZeRO-1, dp1 x tp2 x pp2 with ZeRO-1 (at dp 1 there is no optimizer state to
    partition: each rank holds its tp x pp shard of it whole) and one process load it, and
    every logical tensor they then hold equals the saved one bit for bit;
  * the saved layout resumes from it, and its losses and final state equal those of the
    uninterrupted run bit for bit.
One training launch saves to all backends, and one launch per target world size loads
from all of them, so three backends cost little more than one.

memory:// is a store per process, so it cannot carry bytes between the rank processes by
itself. The launcher carries them instead: each writing rank returns the files its own
memory:// store holds, the test process installs them into its store and commits there,
and each loading rank installs a copy of that committed tree into its store before reading.
Every write and read still goes through `Storage` on memory:// (its writer, its exclusive
create, its range reads); only the hand-over between processes is the test's.
"""

from __future__ import annotations

import contextlib
import gc
import uuid

import fsspec
import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.manifest import ShardReceipt
from ckpt.reader import load_checkpoint, read_manifest, read_slices
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from tests.dist._launch import run_ranks
from tests.s3._seaweed import BUCKET
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.state_slices import assemble

# The module's fixture runs four launches (8, 8, 4 and 1 processes) for all three backends,
# and is charged to the first test: a loaded 2-core machine needs far more than the default.
pytestmark = [pytest.mark.dist, pytest.mark.s3, pytest.mark.timeout(1800)]

STEPS, SAVE_AT = 6, 3
MODEL = ModelConfig(vocab_size=128, n_layers=4, n_heads=4, d_model=32, d_ff=64, max_seq_len=64)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=STEPS, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=2)
SAVED = ParallelConfig(dp=2, tp=2, pp=2, zero=3, schedule="1f1b")
TARGETS = {"dp4 zero1": ParallelConfig(dp=4, zero=1),
           "dp1 tp2 pp2 zero1": ParallelConfig(dp=1, tp=2, pp=2, zero=1)}
KINDS = ("file", "memory", "s3")

Backend = tuple[str, str, dict]  # (kind, url, storage options): picklable, unlike tests/s3/conftest.Backend


def _storage(backend: Backend) -> Storage:
    _, url, options = backend
    return Storage(url, options)


def memory_tree(url: str) -> dict[str, bytes]:
    """Every file under a memory:// root of this process, by path relative to the root."""
    storage = Storage(url)
    return {path[len(storage.root):]: storage.fs.cat_file(path) for path in storage.fs.find(storage.root)}


def install_tree(url: str, files: dict[str, bytes]) -> None:
    storage = Storage(url)
    for rel, data in files.items():
        storage.fs.pipe_file(storage.root + rel, data)


def copies_of(engine: Engine) -> list:
    """The tied embedding's pipeline copies this rank holds (never saved, filled on load)."""
    return [layout.geometry.slice(f"model/{layout.name}", layout.local.dtype, layout.local.detach().clone())
            for layout in engine.layouts if layout.copy]


def train_and_save(rank: int, world_size: int, backends: list[Backend]) -> dict:
    """The uninterrupted run; before step SAVE_AT it saves to every backend and keeps a reference copy."""
    engine = Engine(MODEL, DATA, TRAIN, SAVED, rank=rank, world_size=world_size)
    receipts: dict[str, ShardReceipt] = {}
    errors: list[BaseException] = []
    writers = {kind: ShardWriter(_storage((kind, url, options)), rank,
                                 lambda receipt, extra, kind=kind: receipts.__setitem__(kind, receipt),
                                 lambda step, err: errors.append(err), async_save=True)
               for kind, url, options in backends}
    losses, saved, meta = [], None, None
    for _ in range(STEPS):
        if engine.next_step == SAVE_AT:
            saved, meta = engine.state_slices(), engine.state_meta()
            for writer in writers.values():  # views: the writer stages (copies) what it writes
                writer.save(SAVE_AT, engine.state_slices(copy=False), {})
        losses.append(engine.train_step().loss)
    for writer in writers.values():
        writer.flush()
    assert not errors, errors
    return {"losses": losses, "saved": saved, "meta": meta, "end": engine.state_slices(),
            "receipts": {kind: r.model_dump() for kind, r in receipts.items()},
            "memory": {url: memory_tree(url) for kind, url, _ in backends if kind == "memory"}}


def restore(engine: Engine, backend: Backend, memory: dict[str, dict[str, bytes]]) -> None:
    """What a restoring rank does (orchestrator.rank.state.load_engine_state), on `backend`."""
    kind, url, _ = backend
    if kind == "memory":
        install_tree(url, memory[url])
    catalog = Catalog(_storage(backend))
    manifest = read_manifest(catalog, SAVE_AT)
    engine.load_slices(read_slices(catalog, SAVE_AT, engine.wanted_slices(), manifest=manifest),
                       manifest.state["engine"])


def load_layouts(rank: int, world_size: int, backends: list[Backend], layouts: dict, memory: dict,
                 steps: int = 0) -> dict:
    """Per (backend kind, layout label): the state this rank holds right after loading (slices,
    tied copies), then the losses of `steps` more steps and the state after them."""
    out = {}
    for backend in backends:
        for label, parallel in layouts.items():
            engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
            restore(engine, backend, memory)
            loaded = engine.state_slices(), copies_of(engine)
            losses = [engine.train_step().loss for _ in range(steps)]
            out[backend[0], label] = {"loaded": loaded, "losses": losses, "end": engine.state_slices()}
            del engine
            gc.collect()
    return out


@pytest.fixture(scope="module")
def round_trip(s3_server, tmp_path_factory):
    memory_root = f"undying-test-{uuid.uuid4().hex}"
    backends: list[Backend] = [
        ("file", f"file://{tmp_path_factory.mktemp('round-trip')}/job", {}),
        ("memory", f"memory://{memory_root}/job", {}),
        ("s3", f"s3://{BUCKET}/{uuid.uuid4().hex}/job", s3_server.storage_options),
    ]
    try:
        straight = run_ranks(train_and_save, 8, (backends,), timeout_s=600)
        meta = straight[0]["meta"]
        manifests = {}
        for backend in backends:
            kind, url, _ = backend
            for rank_out in straight:  # the hand-over of memory:// bytes (module docstring)
                if kind == "memory":
                    install_tree(url, rank_out["memory"][url])
            receipts = [ShardReceipt.model_validate(rank_out["receipts"][kind]) for rank_out in straight]
            manifests[kind] = Catalog(_storage(backend)).commit(
                job="round-trip", step=SAVE_AT, generation=0, layout=meta["layout"], spec_hash="h",
                receipts=receipts, state={"engine": meta})
        memory = {url: memory_tree(url) for kind, url, _ in backends if kind == "memory"}
        resumed = run_ranks(load_layouts, 8, (backends, {"same layout": SAVED}, memory, STEPS - SAVE_AT),
                            timeout_s=600)
        others = run_ranks(load_layouts, 4, (backends, TARGETS, memory), timeout_s=600)
        single = load_layouts(0, 1, backends, {"one process": ParallelConfig()}, memory)
        whole = {kind: load_checkpoint(Catalog(_storage((kind, url, options))), SAVE_AT)[0]
                 for kind, url, options in backends}
        yield {"straight": straight, "manifests": manifests, "resumed": resumed, "others": others,
               "single": single, "whole": whole}
    finally:
        with contextlib.suppress(FileNotFoundError):
            fsspec.filesystem("memory").rm(f"/{memory_root}", recursive=True)


def check_equal(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], label: str) -> None:
    assert state.keys() == reference.keys(), label
    for name, value in reference.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), (label, name)


def check_loaded(per_rank: list[dict], key: tuple, reference: dict[str, torch.Tensor]) -> None:
    """The ranks' state right after loading `key` is the saved state: every logical tensor, every tied copy."""
    check_equal(assemble([piece for out in per_rank for piece in out[key]["loaded"][0]]), reference, key)
    for out in per_rank:
        for copy in out[key]["loaded"][1]:
            assert torch.equal(copy.tensor, reference[copy.name][copy.index()]), (key, copy.name)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_state_loads_bit_exact_into_other_layouts(round_trip, kind):
    saved = assemble([piece for out in round_trip["straight"] for piece in out["saved"]])
    assert round_trip["straight"][0]["meta"]["next_step"] == SAVE_AT
    assert any(name.startswith("optim/") for name in saved)  # AdamW state is part of the round trip
    manifest = round_trip["manifests"][kind]
    assert set(manifest.tensors) == set(saved)
    # every byte stored once: the chunks of each tensor add up to exactly its size
    for name, value in saved.items():
        assert sum(c.nbytes for c in manifest.tensors[name].chunks) == value.numel() * value.element_size(), name
    for label in TARGETS:
        check_loaded(round_trip["others"], (kind, label), saved)
    check_loaded([round_trip["single"]], (kind, "one process"), saved)
    check_equal(round_trip["whole"][kind], saved, f"{kind}: load_checkpoint")


@pytest.mark.parametrize("kind", KINDS)
def test_resume_on_the_saved_layout_continues_bit_exact(round_trip, kind):
    straight, key = round_trip["straight"], (kind, "same layout")
    saved = assemble([piece for out in straight for piece in out["saved"]])
    check_loaded(round_trip["resumed"], key, saved)
    for resumed, uninterrupted in zip(round_trip["resumed"], straight, strict=True):
        assert resumed[key]["losses"] == uninterrupted["losses"][SAVE_AT:]
    final = assemble([piece for out in straight for piece in out["end"]])
    check_equal(assemble([piece for out in round_trip["resumed"] for piece in out[key]["end"]]), final, key)
    assert straight[0]["losses"][-1] != straight[0]["losses"][SAVE_AT - 1]  # the resumed steps did train
