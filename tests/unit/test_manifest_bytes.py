"""A manifest is untrusted bytes: chunk paths stay inside the checkpoint, and bytes that are
not a manifest are a corrupt checkpoint with a one-line error, never a traceback."""

from __future__ import annotations

import json

import pytest

from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint
from ckpt.manifest import parse_manifest
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from tests._checkpoints import make_state, save_checkpoint
from tests.unit.test_ckpt_cli import run


@pytest.fixture
def committed(tmp_path) -> tuple[str, Catalog]:
    url = f"file://{tmp_path}/ckpt/job"
    catalog = Catalog(Storage(url))
    for step in (10, 20):
        save_checkpoint(catalog, step, make_state(step))
    return url, catalog


def _rewrite(catalog: Catalog, step: int, data: bytes) -> None:
    catalog.storage.fs.pipe_file(catalog.manifest_path(step), data)
    catalog.storage.invalidate()


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "a/b.bin", "..", ".", "",
                                  "..\\x.bin", "shard\x00.bin", ".hidden", "x" * 300])
def test_a_chunk_outside_the_checkpoint_directory_is_corrupt(committed, tmp_path, name):
    url, catalog = committed
    raw = json.loads(catalog.storage.read(catalog.manifest_path(20)))
    entry = next(iter(raw["tensors"].values()))
    entry["chunks"][0]["file"] = name
    (tmp_path / "escape.bin").write_bytes(b"\0" * 4096)  # what a `..` would reach
    _rewrite(catalog, 20, json.dumps(raw).encode())
    with pytest.raises(CorruptCheckpoint, match="step 20: the manifest does not parse: tensors.*file"):
        load_checkpoint(catalog, 20)
    assert parse_manifest(catalog.storage.read(catalog.manifest_path(10)), 10).step == 10  # the others parse


@pytest.mark.parametrize(("data", "fragment"), [
    (b"\xff\xfe{not utf-8", "not UTF-8 text (byte 0)"),
    (b'{"job": "j", "step": 2', "not JSON (Expecting"),
    (b"[" * 100_000, "not JSON"),
    (b'{"job": 1}', "does not parse"),
])
def test_bytes_that_are_not_a_manifest_are_a_one_line_corrupt_checkpoint(committed, capsys, data, fragment):
    url, catalog = committed
    _rewrite(catalog, 20, data)
    with pytest.raises(CorruptCheckpoint) as caught:
        catalog.read_manifest(20)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    code, out, err = run(capsys, "ls", url)
    assert code == 0 and "Traceback" not in err
    [line] = [line for line in out.splitlines() if line.split()[:1] == ["20"]]
    assert "unreadable: step 20: the manifest" in line and fragment in line
    code, out, err = run(capsys, "verify", url)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "step 10: ok" in out and "step 20: CORRUPT: the manifest" in out and fragment in out


def test_a_manifest_of_another_step_is_corrupt(committed):
    _, catalog = committed
    _rewrite(catalog, 20, catalog.storage.read(catalog.manifest_path(10)))
    with pytest.raises(CorruptCheckpoint, match="step 20: the manifest is that of step 10"):
        catalog.read_manifest(20)


def test_a_chunk_whose_offset_moved_is_corrupt_even_when_the_volumes_still_add_up(committed):
    # Two chunks [0:h) and [h:n) of one tensor; a flipped digit moves the first to [1:h+1): it overlaps
    # the second and leaves element 0 unstored, with the same total volume. It must not load.
    _, catalog = committed
    raw = json.loads(catalog.storage.read(catalog.manifest_path(20)))
    name, entry = next((n, e) for n, e in raw["tensors"].items() if e["shape"] and e["shape"][0] >= 4)
    [chunk] = entry["chunks"]
    n, h = entry["shape"][0], entry["shape"][0] // 2
    first = dict(chunk, offsets=[0, *chunk["offsets"][1:]], lengths=[h, *chunk["lengths"][1:]])
    second = dict(chunk, offsets=[h, *chunk["offsets"][1:]], lengths=[n - h, *chunk["lengths"][1:]])
    entry["chunks"] = [first, second]
    assert parse_manifest(json.dumps(raw).encode(), 20).tensors[name].chunks[1].offsets[0] == h  # tiles: parses
    first["offsets"] = [1, *chunk["offsets"][1:]]
    with pytest.raises(CorruptCheckpoint, match=f"step 20: the manifest's chunks do not tile the tensor {name}: "
                                                "overlapping"):
        parse_manifest(json.dumps(raw).encode(), 20)
    second["offsets"] = [h, 0, 0, 0][:len(entry["shape"]) - 1]  # a chunk of fewer dimensions than the tensor
    with pytest.raises(CorruptCheckpoint, match="lies outside"):
        parse_manifest(json.dumps(raw).encode(), 20)


def test_a_training_state_that_resumes_at_another_step_is_corrupt(committed):
    # The state has no checksum of its own: a flipped digit of its step would shift every rank's data
    # and schedule with every tensor intact.
    _, catalog = committed
    raw = json.loads(catalog.storage.read(catalog.manifest_path(20)))
    raw["state"]["engine"] = {**raw["state"].get("engine", {}), "next_step": 20}
    assert parse_manifest(json.dumps(raw).encode(), 20).state["engine"]["next_step"] == 20
    raw["state"]["engine"]["next_step"] = 80
    with pytest.raises(CorruptCheckpoint, match="step 20: the manifest's training state resumes at step 80"):
        parse_manifest(json.dumps(raw).encode(), 20)


def test_a_total_size_below_what_the_chunks_occupy_is_corrupt(committed):
    # total_bytes sets the restore's time limit: a flipped digit making it small would have the ranks
    # killed as hung at every rerun, the checkpoint blamed on no one.
    _, catalog = committed
    raw = json.loads(catalog.storage.read(catalog.manifest_path(20)))
    occupied = sum(max(c["byte_offset"] + c["nbytes"] for e in raw["tensors"].values() for c in e["chunks"]
                       if c["file"] == file) for file in {c["file"] for e in raw["tensors"].values()
                                                          for c in e["chunks"]})
    assert raw["total_bytes"] >= occupied > 0
    raw["total_bytes"] = occupied
    assert parse_manifest(json.dumps(raw).encode(), 20).total_bytes == occupied
    for bad, words in ((occupied - 1, f"total_bytes {occupied - 1} is below the {occupied} bytes its chunks occupy"),
                       (-5, "total_bytes: Input should be greater than or equal to 0")):
        raw["total_bytes"] = bad
        with pytest.raises(CorruptCheckpoint, match=f"step 20: the manifest('s| does not parse:) {words}"):
            parse_manifest(json.dumps(raw).encode(), 20)
