"""Fuzz the manifest parser: any bytes give a Manifest or a one-line CorruptCheckpoint (or
UnsupportedManifest for another schema version), never another exception, and a manifest that
parses names only shard files inside its checkpoint directory."""

from __future__ import annotations

import json
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint, UnsupportedManifest
from ckpt.manifest import SHARD_FILE, Manifest, parse_manifest
from ckpt.storage import Storage
from tests._checkpoints import make_state, save_checkpoint
from tests._fuzz import fuzz, mutated, mutated_bytes

STEP = 10


def _valid_manifest() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        catalog = Catalog(Storage(f"file://{tmp}/job"))
        save_checkpoint(catalog, STEP, make_state(1), world=2)
        return catalog.storage.read(catalog.manifest_path(STEP))


VALID = _valid_manifest()


def _parses_cleanly(data: bytes) -> Manifest | None:
    try:
        manifest = parse_manifest(data, STEP)
    except (CorruptCheckpoint, UnsupportedManifest) as err:
        assert str(err) and ("\n" not in str(err) or isinstance(err, UnsupportedManifest))
        return None
    files = {c.file for entry in manifest.tensors.values() for c in entry.chunks}
    assert all(SHARD_FILE.fullmatch(f) for f in files), files
    return manifest


def test_the_valid_manifest_parses():
    assert _parses_cleanly(VALID) is not None


@fuzz(150)
@given(st.binary(max_size=300))
def test_random_bytes(data):
    _parses_cleanly(data)


@fuzz(150)
@given(mutated_bytes(VALID))
def test_byte_mutations_of_a_valid_manifest(data):
    _parses_cleanly(data)


@fuzz(200)
@given(mutated(json.loads(VALID)))
def test_json_mutations_of_a_valid_manifest(document):
    _parses_cleanly(json.dumps(document).encode())


@fuzz(60)
@given(st.sampled_from(["file", "byte_offset", "nbytes", "block_bytes", "offsets", "lengths"]),
       st.one_of(st.text(max_size=20), st.integers(-5, 5), st.lists(st.integers(-3, 3), max_size=3)))
def test_chunk_fields(field, value):
    document = json.loads(VALID)
    chunk = next(iter(document["tensors"].values()))["chunks"][0]
    chunk[field] = value
    manifest = _parses_cleanly(json.dumps(document).encode())
    if field == "file" and manifest is not None:
        assert isinstance(value, str) and ".." not in value.split("/") and "/" not in value


@pytest.mark.parametrize("version", [1, 3, "2", None])
def test_another_schema_version_is_refused_by_name(version):
    document = dict(json.loads(VALID), schema_version=version)
    with pytest.raises((UnsupportedManifest, CorruptCheckpoint)):
        parse_manifest(json.dumps(document).encode(), STEP)


def test_unknown_fields_alone_are_a_newer_writer_s_and_a_damaged_key_is_corruption():
    document = json.loads(VALID)
    with pytest.raises(UnsupportedManifest, match=r"does not know \(compression\).*newer undying"):
        parse_manifest(json.dumps(dict(document, compression="zstd")).encode(), STEP)
    damaged = {("spec_hasj" if key == "spec_hash" else key): value for key, value in document.items()}
    with pytest.raises(CorruptCheckpoint):
        parse_manifest(json.dumps(damaged).encode(), STEP)
    # A damaged key of a field with a default (a tensor's chunks) leaves the manifest whole only in
    # its keys: without its unknown field it does not tile the tensor, so it is damage too.
    entry = next(iter(document["tensors"]))
    unchunked = json.loads(VALID)
    unchunked["tensors"][entry]["chunkz"] = unchunked["tensors"][entry].pop("chunks")
    with pytest.raises(CorruptCheckpoint, match="chunkz"):
        parse_manifest(json.dumps(unchunked).encode(), STEP)
    nested = json.loads(VALID)
    nested["tensors"][entry]["chunks"][0]["compression"] = "zstd"  # a newer writer's field, anywhere
    with pytest.raises(UnsupportedManifest, match=r"does not know \(tensors\..*compression\)"):
        parse_manifest(json.dumps(nested).encode(), STEP)


def test_a_dtype_this_torch_lacks_is_refused_as_the_manifest_parses_and_kept():
    # A newer torch's dtype or a damaged name: no proof of damage, so not corruption (no quarantine).
    document = json.loads(VALID)
    next(iter(document["tensors"].values()))["dtype"] = "float8_e9m9"
    with pytest.raises(UnsupportedManifest, match="dtype 'float8_e9m9', which this torch .* does not have"):
        parse_manifest(json.dumps(document).encode(), STEP)
