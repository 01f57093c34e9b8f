"""Storage faults against the real checkpoint code: commits that fail, lost replies, torn and rotten shards."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from chaos.corrupt import corrupt_shard
from chaos.storage_faults import FaultyFileSystem, InjectedStorageError, StorageFaultPlan, install
from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.reader import CorruptCheckpoint, load_checkpoint, newest_loadable, verify_checkpoint
from ckpt.shards import owned_by, write_shard
from ckpt.storage import Storage

WORLD = 2


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model/w": torch.randn(64, 16, generator=g), "model/b": torch.randn(16, generator=g),
            "optim/w/step": torch.tensor(float(seed))}


def _receipts(storage: Storage, step: int, state: dict) -> list:
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    return [write_shard(storage, step, rank, {n: state[n] for n in owned_by(rank, WORLD, sizes)}, blocking_s=0.0)
            for rank in range(WORLD)]


def _commit(catalog: Catalog, step: int, receipts: list) -> None:
    catalog.commit(job="j", step=step, generation=0, layout={"dp": WORLD}, spec_hash="h",
                   receipts=receipts, state={"engine": {"next_step": step}})


def _save(catalog: Catalog, step: int, state: dict) -> None:
    _commit(catalog, step, _receipts(catalog.storage, step, state))


def _assert_loads(catalog: Catalog, step: int, state: dict) -> None:
    tensors, _ = load_checkpoint(catalog, step)
    assert set(tensors) == set(state)
    for name, value in state.items():
        assert torch.equal(tensors[name], value), name


@pytest.fixture(params=["file", "memory"])
def catalog(request, tmp_path) -> Catalog:
    if request.param == "file":
        return Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    return Catalog(Storage(f"memory://chaos-{uuid.uuid4().hex}/job"))


def test_error_before_manifest_commit_leaves_previous_checkpoint(catalog):
    _save(catalog, 10, _state(10))
    fault = {"kind": "storage_error", "op": "write", "path": "*/manifest.json"}
    with install(catalog.storage, [fault]) as faults, pytest.raises(InjectedStorageError):
        _save(catalog, 20, _state(20))
    assert [e["mode"] for e in faults.plan.fired] == ["before"]
    assert catalog.all_steps() == [10, 20]  # the shards of 20 were written; only the commit failed
    assert catalog.committed_steps() == [10]
    assert newest_loadable(catalog) == 10
    _assert_loads(catalog, 10, _state(10))


def test_error_after_manifest_commit_still_leaves_a_checkpoint_that_verifies(catalog):
    _save(catalog, 10, _state(10))
    state = _state(20)
    receipts = _receipts(catalog.storage, 20, state)
    fault = {"kind": "storage_error", "op": "write", "path": "*/manifest.json", "when": "after"}
    with install(catalog.storage, [fault]), pytest.raises(InjectedStorageError, match="succeeded"):
        _commit(catalog, 20, receipts)
    # The controller saw an error, yet the commit landed: the checkpoint exists and is whole,
    # and the controller's retry of the same commit is accepted as the same checkpoint.
    assert catalog.committed_steps() == [10, 20]
    verify_checkpoint(catalog, 20)
    _commit(catalog, 20, receipts)
    _assert_loads(catalog, 20, state)


def test_a_torn_retry_of_a_landed_manifest_commit_never_replaces_the_committed_manifest(catalog):
    # The commit's reply was lost after it landed ("after"), then its retry meets a torn write: a
    # real conditional put replaces nothing, so neither may the fault; the checkpoint stays whole.
    _save(catalog, 10, _state(10))
    state = _state(20)
    receipts = _receipts(catalog.storage, 20, state)
    faults = [{"kind": "storage_error", "op": "write", "path": "*/manifest.json", "when": "after", "nth": 1},
              {"kind": "torn_write", "path": "*/manifest.json", "keep_fraction": 0.5, "nth": 2}]
    with install(catalog.storage, faults):
        with pytest.raises(InjectedStorageError, match="succeeded"):
            _commit(catalog, 20, receipts)
        if catalog.storage.is_local:  # (memory:// looks before it writes: the retry finds its manifest)
            with pytest.raises(InjectedStorageError, match="nothing landed"):
                _commit(catalog, 20, receipts)
    verify_checkpoint(catalog, 20)
    _assert_loads(catalog, 20, state)


def test_torn_shard_write_never_yields_a_checkpoint_that_verifies(catalog, tmp_path):
    _save(catalog, 10, _state(10))
    state = _state(20)
    fault = {"kind": "torn_write", "path": "*/shard-r00001.bin", "keep_fraction": 0.5}
    with install(catalog.storage, [fault]), pytest.raises(InjectedStorageError, match="bytes landed"):
        _receipts(catalog.storage, 20, state)
    assert catalog.committed_steps() == [10]  # the rank reported no receipt, so nothing was committed
    torn = catalog.storage.read(catalog.storage.path(step_dir(20), "shard-r00001.bin"))
    # Even a controller that commits anyway (receipts of the intended bytes) gets a checkpoint
    # that is refused on read, never one that silently loads half a shard.
    intended = _receipts(Storage(f"file://{tmp_path}/scratch"), 20, state)
    assert 0 < len(torn) < intended[1].nbytes
    _commit(catalog, 20, intended)
    assert catalog.committed_steps() == [10, 20]
    with pytest.raises(CorruptCheckpoint):
        verify_checkpoint(catalog, 20)
    assert newest_loadable(catalog) == 10


def test_flipped_bit_is_caught_and_newest_loadable_falls_back(catalog, tmp_path):
    _save(catalog, 10, _state(10))
    _save(catalog, 20, _state(20))
    path = catalog.storage.path(step_dir(20), "shard-r00000.bin")
    before = catalog.storage.read(catalog.storage.path(step_dir(20), "shard-r00001.bin")), catalog.storage.read(path)
    hit = corrupt_shard(catalog.storage, 20, seed=3)
    after = catalog.storage.read(hit.path)
    original = before[0] if hit.file == "shard-r00001.bin" else before[1]
    assert [i for i in range(len(after)) if after[i] != original[i]] == [hit.byte]
    assert after[hit.byte] ^ original[hit.byte] == 1 << hit.bit
    assert catalog.storage.exists(catalog.manifest_path(20))  # the manifest stays
    with pytest.raises(CorruptCheckpoint):
        verify_checkpoint(catalog, 20)
    skipped = []
    assert newest_loadable(catalog, on_fallback=lambda step, err: skipped.append(step)) == 10
    assert skipped == [20]
    # Seeded: the same checkpoint elsewhere gets the same bit flipped.
    twin = Catalog(Storage(f"file://{tmp_path}/twin/job"))
    _save(twin, 20, _state(20))
    again = corrupt_shard(twin.storage, 20, seed=3)
    assert (again.file, again.byte, again.bit, again.tensor) == (hit.file, hit.byte, hit.bit, hit.tensor)


def test_errors_before_and_after_a_shard_write(catalog):
    storage = catalog.storage
    path = storage.path(step_dir(5), "shard-r00000.bin")
    with install(storage, [{"kind": "storage_error", "path": "*/shard-*"}]), pytest.raises(InjectedStorageError):
        storage.write_immutable(path, b"abc")
    assert not storage.exists(path)
    after = {"kind": "storage_error", "path": "*/shard-*", "when": "after"}
    with install(storage, [after]), pytest.raises(InjectedStorageError):
        storage.write_immutable(path, b"abc")
    assert storage.read(path) == b"abc"


def test_latency_filters_by_operation_and_path(catalog):
    _save(catalog, 10, _state(10))
    slept = []
    fault = {"kind": "storage_latency", "delay_s": "250ms", "op": "read", "path": "*/shard-*"}
    with install(catalog.storage, [fault], sleep=slept.append) as faults:
        _assert_loads(catalog, 10, _state(10))
        catalog.committed_steps()  # listings are not reads
        catalog.read_manifest(10)  # a read, but not of a shard
    assert slept and set(slept) == {0.25}
    shard_reads = len(slept)
    assert [e["kind"] for e in faults.plan.fired] == ["storage_latency"]  # reported once
    with install(catalog.storage, [dict(fault, path="*/nothing-*")], sleep=slept.append):
        load_checkpoint(catalog, 10)
    assert len(slept) == shard_reads


def test_real_latency_is_added_to_the_call(catalog):
    import time

    catalog.storage.write_immutable(catalog.storage.path("x", "f.bin"), b"1")
    with install(catalog.storage, [{"kind": "storage_latency", "delay_s": 0.05, "op": "read"}]):
        started = time.perf_counter()
        catalog.storage.read(catalog.storage.path("x", "f.bin"))
        assert time.perf_counter() - started >= 0.05


def test_undo_restores_the_storage_and_other_users_never_see_faults():
    root = f"memory://chaos-{uuid.uuid4().hex}/job"
    mine, theirs = Storage(root), Storage(root)
    original_fs = mine.fs
    undo = install(mine, [{"kind": "storage_error", "op": "read", "repeat": True}])
    mine.write_immutable(mine.path("a.bin"), b"data")
    assert theirs.read(theirs.path("a.bin")) == b"data"  # same store, no faults
    plain = fsspec.filesystem("memory")
    assert not isinstance(plain, FaultyFileSystem) and plain.cat_file(mine.path("a.bin")) == b"data"
    with pytest.raises(InjectedStorageError):
        mine.read(mine.path("a.bin"))
    with pytest.raises(InjectedStorageError):
        mine.read(mine.path("a.bin"))  # repeat: every read fails
    undo()
    undo()  # idempotent
    assert mine.fs is original_fs and mine.read(mine.path("a.bin")) == b"data"


def test_wrapper_is_never_cached_and_leaves_the_wrapped_instance_alone():
    inner = fsspec.filesystem("memory")
    plan = StorageFaultPlan([{"kind": "storage_error", "op": "write", "repeat": True}])
    first, second = FaultyFileSystem(inner, plan), FaultyFileSystem(inner, plan)
    assert first is not second and FaultyFileSystem.cachable is False
    assert type(inner).__name__ == "MemoryFileSystem" and "plan" not in vars(inner)
    path = f"/chaos-{uuid.uuid4().hex}/f"
    with pytest.raises(InjectedStorageError):
        first.pipe_file(path, b"x")
    inner.pipe_file(path, b"x")  # the wrapped instance itself is unaffected
    assert first.cat_file(path) == b"x" and first.exists(path)


def test_local_undo_removes_the_shadowed_writers(tmp_path):
    storage = Storage(f"file://{tmp_path}/job")
    outer = install(storage, [{"kind": "storage_error", "op": "write", "repeat": True}])
    inner = install(storage, [{"kind": "storage_latency", "delay_s": 1.0, "op": "read"}], sleep=lambda s: None)
    with pytest.raises(RuntimeError, match="reverse order"):
        outer()
    inner()
    with pytest.raises(InjectedStorageError):
        storage.write_immutable(storage.path("a"), b"1")  # the outer fault is still there
    outer()
    assert "write_immutable" not in vars(storage) and "create_exclusive" not in vars(storage)
    storage.write_immutable(storage.path("a"), b"1")
    with storage.atomic_writer(storage.path("b")) as f:
        f.write(b"2")
    assert storage.read(storage.path("b")) == b"2"


def test_torn_write_through_open_lands_a_prefix_then_fails():
    inner = fsspec.filesystem("memory")
    faulty = FaultyFileSystem(inner, StorageFaultPlan([{"kind": "torn_write", "keep_fraction": 0.25}]))
    path = f"/chaos-{uuid.uuid4().hex}/big.bin"
    with pytest.raises(InjectedStorageError, match="2 of 8 bytes"), faulty.open(path, "wb") as f:
        f.write(b"abcd")
        f.write(b"efgh")
    assert inner.cat_file(path) == b"ab"
    with faulty.open(path, "wb") as f:  # fired once: the next write is whole
        f.write(b"whole")
    assert inner.cat_file(path) == b"whole"


def test_a_held_write_keeps_the_bytes_it_was_given_not_the_callers_buffer():
    # Shard writes reuse one buffer for successive chunks once `write` returns; a file that
    # holds writes until close must land what each write was given.
    inner = fsspec.filesystem("memory")
    faulty = FaultyFileSystem(inner, StorageFaultPlan([{"kind": "storage_error", "op": "write", "when": "after"}]))
    path = f"/chaos-{uuid.uuid4().hex}/reused.bin"
    buffer = bytearray(b"abcd")
    with pytest.raises(InjectedStorageError), faulty.open(path, "wb") as f:
        f.write(memoryview(buffer))
        buffer[:] = b"efgh"
        f.write(memoryview(buffer))
    assert inner.cat_file(path) == b"abcdefgh"


def test_atomic_writer_on_local_storage_is_judged_as_one_write(tmp_path):
    storage = Storage(f"file://{tmp_path}/job")
    torn = {"kind": "torn_write", "path": "*/m.json"}
    with install(storage, [torn]), pytest.raises(InjectedStorageError), storage.atomic_writer(
            storage.path("m.json")) as f:
        f.write(b"0123456789")
    assert storage.read(storage.path("m.json")) == b"01234"


def test_a_torn_write_through_a_handle_that_publishes_on_commit_still_lands_its_prefix():
    # ckpt.storage's S3 atomic writer opens with autocommit=False: the object appears only at
    # commit(), and the writer discards the upload when the write raises. The fault's prefix must
    # land all the same (as on every other backend), and the discard must not take it back.
    from chaos.storage_faults import _FaultyWriteFile
    from chaos.storage_rules import Verdict

    class Upload:  # the part of s3fs's S3File the writer and the fault use
        autocommit = False

        def __init__(self):
            self.buffer, self.published, self.discarded = b"", None, False

        def write(self, data):
            self.buffer += data

        def close(self):
            pass

        def commit(self):
            self.published = self.buffer

        def discard(self):
            self.discarded = True

    upload = Upload()
    torn = _FaultyWriteFile(upload, Verdict(keep_fraction=0.5, reason="torn_write"), "s/big.bin")
    torn.write(b"abcdefgh")
    with pytest.raises(InjectedStorageError, match="4 of 8 bytes landed"):
        torn.close()
    torn.discard()
    assert upload.published == b"abcd" and not upload.discarded


def test_a_probability_fault_draws_the_same_sequence_whatever_its_place_in_the_list():
    from chaos.config import ArmedFault, FaultSpec
    from chaos.storage_rules import StorageFaultPlan

    flaky = ArmedFault.of(FaultSpec(kind="storage_error", op="read", probability=0.5, repeat=True), 3)
    once = ArmedFault.of(FaultSpec(kind="storage_error", op="write", nth=1), 0)

    def draws(faults):
        rule = next(r for r in StorageFaultPlan(faults, seed=7).rules if r.fault.id == 3)
        return [rule.triggers() for _ in range(32)]

    # A rank's list before and after its one-shot fault fired (armed() drops it): the same draws.
    assert draws([once, flaky]) == draws([flaky])
