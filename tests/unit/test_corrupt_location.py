"""A rank's proof of corruption names the bytes it read (`CorruptCheckpoint.location`), and the
controller checks those bytes, not the whole checkpoint, before it quarantines: on a large
checkpoint a whole verification would hold the recovery for as long as reading all of it."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from ray.exceptions import RayTaskError

from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint
from ckpt.manifest import step_dir
from ckpt.reader import load_checkpoint, verify_location
from ckpt.storage import Storage
from orchestrator.controller import restore_policy
from orchestrator.controller.restore_policy import RestorePolicy
from tests._checkpoints import flip_bit, save_checkpoint, shard_of


def big_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model/w{i}": torch.randn(1024, 1024, generator=g) for i in range(4)}  # 4 MiB each, 4 blocks


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    for step in (10, 20):
        save_checkpoint(catalog, step, big_state(step), world=2)
    return catalog


def rank_error(catalog: Catalog, step: int) -> CorruptCheckpoint:
    """The error a rank's restore raises, as the controller gets it (pickled, as Ray carries it)."""
    with pytest.raises(CorruptCheckpoint) as caught:
        load_checkpoint(catalog, step)
    return pickle.loads(pickle.dumps(caught.value))


def test_a_checksum_mismatch_names_its_block_and_that_block_alone_is_proof(catalog):
    manifest = catalog.read_manifest(20)
    chunk, other = manifest.tensors["model/w1"].chunks[0], manifest.tensors["model/w2"].chunks[-1]
    block = min(chunk.nbytes, chunk.block_bytes)
    offset = chunk.byte_offset + 5
    flip_bit(catalog, 20, chunk.file, offset)
    err = rank_error(catalog, 20)
    assert err.location == (chunk.file, chunk.byte_offset, chunk.byte_offset + block)
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        verify_location(catalog, 20, err.location)
    intact = (other.file, other.byte_offset, other.byte_offset + 64)  # another chunk's first block
    checked = verify_location(catalog, 20, intact)
    assert checked == min(other.nbytes, other.block_bytes) and 8 * checked <= manifest.total_bytes


def test_a_missing_shard_names_the_range_it_could_not_read(catalog):
    file = shard_of(catalog, 20, "model/w0")
    os.remove(catalog.storage.path(step_dir(20), file))
    err = rank_error(catalog, 20)
    assert err.location[0] == file
    with pytest.raises(CorruptCheckpoint, match="cannot be read"):
        verify_location(catalog, 20, err.location)
    with pytest.raises(CorruptCheckpoint, match="names no bytes"):
        verify_location(catalog, 20, ("shard-nobody.bin", 0, 64))


def test_the_controller_quarantines_on_the_named_bytes_without_reading_the_whole_checkpoint(catalog, monkeypatch):
    file = shard_of(catalog, 20, "model/w3")
    flip_bit(catalog, 20, file, catalog.read_manifest(20).tensors["model/w3"].chunks[0].byte_offset + 9)
    err = rank_error(catalog, 20)
    monkeypatch.setattr(restore_policy, "verify_checkpoint", lambda *a, **k: pytest.fail("read the whole step"))
    policy = RestorePolicy(catalog, read_retry_s=0.0)
    line = policy.on_corrupt(20, err)
    assert "moved aside" in line and catalog.committed_steps() == [10]


def test_bytes_that_read_intact_here_leave_the_step_committed_and_skipped_not_verified_whole(catalog, monkeypatch):
    file = shard_of(catalog, 20, "model/w2")
    err = CorruptCheckpoint(f"step 20: checksum mismatch in {file} (read twice)")  # a rank's read was garbled
    err.location = (file, 0, 64)
    policy = RestorePolicy(catalog, read_retry_s=0.0)
    monkeypatch.setattr(restore_policy, "verify_checkpoint", lambda *a, **k: pytest.fail("read the whole step"))
    as_ray_raises_it = RayTaskError("restore", "traceback", pickle.loads(pickle.dumps(err))).as_instanceof_cause()
    assert isinstance(as_ray_raises_it, CorruptCheckpoint)
    line = policy.on_corrupt(20, as_ray_raises_it)
    assert "read intact here" in line and "stays committed" in line
    assert catalog.committed_steps() == [10, 20] and 20 in policy.bad and 20 not in policy.intact
    assert policy.restore_point() == 10
    monkeypatch.undo()
    assert policy.verify_fully(20) and 20 in policy.intact  # as the job's final step needs it


def test_a_manifest_a_rank_could_not_read_is_checked_by_reading_the_manifest_only(catalog, monkeypatch):
    from ckpt.reader import read_manifest

    stale_view = catalog.storage.read  # a rank's stale view of the store (a mount, a cache): no manifest there
    monkeypatch.setattr(catalog.storage, "read", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    with pytest.raises(CorruptCheckpoint) as caught:
        read_manifest(catalog, 20)
    monkeypatch.setattr(catalog.storage, "read", stale_view)
    err = pickle.loads(pickle.dumps(caught.value))
    assert err.location == ("manifest.json", 0, 0)
    monkeypatch.setattr(restore_policy, "verify_checkpoint", lambda *a, **k: pytest.fail("read the whole step"))
    line = RestorePolicy(catalog, read_retry_s=0.0).on_corrupt(20, err)
    assert "its manifest reads intact here" in line and catalog.committed_steps() == [10, 20]
    manifest = step_dir(20) + "/manifest.json"
    (catalog.storage.fs.pipe_file(catalog.storage.path(manifest), b"{not json"), catalog.storage.invalidate())
    assert "moved aside" in RestorePolicy(catalog, read_retry_s=0.0).on_corrupt(20, err)  # proven here too
    assert catalog.committed_steps() == [10]


def test_an_error_without_a_location_is_checked_whole_as_before(catalog):
    flip_bit(catalog, 20, shard_of(catalog, 20, "model/w0"), 100)
    policy = RestorePolicy(catalog, read_retry_s=0.0)
    assert "moved aside" in policy.on_corrupt(20, CorruptCheckpoint("step 20: the manifest does not parse"))
    assert catalog.committed_steps() == [10]


def test_damaged_hugging_face_weights_fail_the_start_naming_them_not_a_step(tmp_path):
    from orchestrator.controller.restore_policy import NoRestorePoint

    policy = RestorePolicy(Catalog(Storage(f"file://{tmp_path}/empty/job")), read_retry_s=0.0)
    err = CorruptCheckpoint("model-00001.safetensors: checksum mismatch")
    err.location = ("model-00001.safetensors", 0, 64)
    line = policy.on_corrupt(None, err)
    assert line.startswith("model.from_hf's weights do not read intact") and "step None" not in line
    with pytest.raises(NoRestorePoint, match=r"model.from_hf's weights do not read intact") as caught:
        policy.restore_point()
    assert "step None" not in str(caught.value)
