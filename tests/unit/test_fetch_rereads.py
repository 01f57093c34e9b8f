"""A block whose checksum mismatches is read once more before it is proof of corruption: one read
damaged in flight (a proxy, a NIC; a ranged GET has no end-to-end checksum) must neither fail a
rank's restore nor make the controller quarantine a good checkpoint; bytes that are bad where they
are stored still are corruption."""

from __future__ import annotations

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint
from ckpt.reader import load_checkpoint, verify_checkpoint
from tests._checkpoints import flip_bit, make_state, save_checkpoint, shard_of
from tests._counting_storage import CountingStorage


class DamagesFirstRead(CountingStorage):
    """Flips a bit of the first read of `file` only, as a damaged reply would."""

    file = ""

    def read_range_into(self, path, start, out):
        got = super().read_range_into(path, start, out)
        if path.endswith(self.file) and sum(1 for name, *_ in self.reads if self.file.endswith(name)) == 1:
            out[0] ^= 0x40
        return got


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    catalog = Catalog(DamagesFirstRead(f"file://{tmp_path}/job"))
    save_checkpoint(catalog, 10, make_state(10))
    return catalog


def test_a_read_damaged_in_flight_is_read_again_and_the_restore_goes_on(catalog):
    catalog.storage.file = shard_of(catalog, 10, "model/w")
    tensors, _ = load_checkpoint(catalog, 10)
    for name, value in make_state(10).items():
        assert torch.equal(tensors[name], value), name
    first, again = [r for r in catalog.storage.reads if r[0] == catalog.storage.file][:2]
    assert again[1] >= first[1] and again[2] <= first[2]  # the mismatching block, read again
    catalog.storage.reads.clear()
    verify_checkpoint(catalog, 10)  # the controller's own verification: no proof either


def test_bytes_bad_where_they_are_stored_are_corruption_read_twice(catalog):
    file = shard_of(catalog, 10, "model/w")
    flip_bit(catalog, 10, file)
    with pytest.raises(CorruptCheckpoint, match=r"checksum mismatch in .*\(read twice\)"):
        verify_checkpoint(catalog, 10)


def test_a_store_that_ignores_range_requests_is_named_not_taken_for_corruption():
    """A server (or proxy) that answers a ranged GET with the whole object: the bytes are intact, so
    the checkpoint must not be quarantined; the restore fails naming the store's behaviour."""
    import uuid

    from ckpt.storage import Storage
    from trainer.urls import RangeIgnored

    catalog = Catalog(Storage(f"memory://undying-test-{uuid.uuid4().hex}/job"))  # read by ranges, as S3
    save_checkpoint(catalog, 10, make_state(10))
    whole = catalog.storage.fs.cat_file
    catalog.storage.fs.cat_file = lambda path, start=None, end=None, **kw: whole(path)
    with pytest.raises(RangeIgnored, match="ignores HTTP Range requests") as failed:
        load_checkpoint(catalog, 10, ["model/b"])  # a part of its shard file
    assert not isinstance(failed.value, CorruptCheckpoint)
    catalog.storage.fs.rm(catalog.storage.root, recursive=True)
