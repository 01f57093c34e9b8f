"""Torn writes: a checkpoint writer SIGKILLed anywhere in a save never leaves a checkpoint that
is listed and loaded without verifying, and the previous one stays loadable (docs/design.md
invariant 1); a flipped bit in a committed shard is caught by `verify` and `load`.

The writer is a real subprocess (tests/_torn_writer.py: ranks' ShardWriters, the
controller's Committer) forked from a server that has imported torch once. Each kill gets a
fresh checkpoint root, so kills are independent. Kill points are seeded: most fall at a
random time over the whole step-20 save (measured first), some right after the last shard
receipt (racing the manifest create), and a few are exact (the writer stops at a named
event: before the first shard, mid-way through the big shard, just before the manifest
create, and on S3 once the big shard's first part is uploaded) so that every stage, and a
kill mid multipart upload, is surely hit.

On s3:// (real SeaweedFS) the big shard goes multipart (5 MiB parts); every shard object
that is visible after a kill must have exactly its final bytes, and a multipart upload left
pending by the kill must be aborted by checkpoint GC once a newer step commits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import random
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.reader import CorruptCheckpoint, load_checkpoint, newest_loadable, verify_checkpoint
from ckpt.storage import Storage
from orchestrator.cli.main import main
from tests._checkpoints import flip_bit, make_state, save_checkpoint
from tests._torn_kills import (
    NEW,
    OLD,
    PART,
    STAGES,
    Outcome,
    Plan,
    digest,
    fork_server,
    plans,
    run_writer,
    settled_steps,
    shard_objects,
    stage_of,
)
from tests._torn_writer import BIG_SHARD, WORLD, logical_state
from tests.s3._seaweed import BUCKET
from tests.s3.conftest import cli_options

SEED = 20240917
ROW = re.compile(r"^\s*(\d+)  \S")


@dataclass
class Tally:
    stages: collections.Counter = field(default_factory=collections.Counter)
    kinds: collections.Counter = field(default_factory=collections.Counter)
    committed: int = 0
    mid_multipart: int = 0
    pending_after_kill: int = 0  # kills that left a multipart upload pending (S3)
    aborted_by_gc: int = 0


@pytest.fixture(scope="module", name="fork_server")
def _fork_server():
    with fork_server() as proc:
        yield proc


# -- storage --------------------------------------------------------------------------------

@dataclass
class Place:
    kind: str
    base: str
    options: dict

    def url(self, name: str) -> str:
        return f"{self.base}/{name}/job"

    def catalog(self, url: str) -> Catalog:
        return Catalog(Storage(url, self.options))

    def cli_options(self) -> list[str]:
        return cli_options(self.options)


def _place(kind: str, request, tmp_path) -> Place:
    if kind == "file":
        return Place("file", f"file://{tmp_path}/ckpt", {})
    server = request.getfixturevalue("s3_server")
    return Place("s3", f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options)


@functools.lru_cache(maxsize=2)
def expected_state(step: int) -> dict[str, torch.Tensor]:
    return logical_state(step)


def assert_state(catalog: Catalog, step: int) -> None:
    tensors, manifest = load_checkpoint(catalog, step)
    want = expected_state(step)
    assert manifest.step == step and set(tensors) == set(want)
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), f"step {step}: {name} differs"


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["ckpt", *argv])
    return code, out.getvalue(), err.getvalue()


def listed_steps(place: Place, url: str) -> list[int]:
    code, out, err = cli("ls", url, *place.cli_options())
    assert code == 0, err
    return [int(m.group(1)) for line in out.splitlines() if (m := ROW.match(line))]


# -- after a kill ------------------------------------------------------------------------------

def check_after_kill(place: Place, url: str, out: Outcome, shards: dict[str, str], tally: Tally) -> None:
    catalog = place.catalog(url)
    committed = settled_steps(catalog)
    assert listed_steps(place, url) == committed, "`undying ckpt ls` and the catalog disagree"
    assert committed in ([OLD], [OLD, NEW]), committed
    new = NEW in committed
    # The commit is the manifest create: before it began the step cannot be committed; once
    # it returned, it must be.
    if f"manifest_end {step_dir(NEW)}" in out.events:
        assert new, "the manifest create returned but step 20 is not committed"
    if f"manifest_begin {step_dir(NEW)}" not in out.events:
        assert not new, "step 20 is committed although its manifest create never began"
    stage = stage_of(out.events, new)
    tally.stages[stage] += 1
    tally.committed += new
    parts_open = {e.split()[1] for e in out.events if e.startswith("part ")} - {
        e.split()[1] for e in out.events if e.startswith("shard_close ")}
    if parts_open and not new:
        tally.mid_multipart += 1

    assert_state(catalog, OLD)  # the previous checkpoint always loads, bit for bit
    if new:
        verify_checkpoint(catalog, NEW)
        assert_state(catalog, NEW)
    assert newest_loadable(catalog) == committed[-1]

    # No torn object is ever visible: a shard is there with its final bytes, or not at all.
    for name in shard_objects(catalog, NEW):
        assert digest(catalog, NEW, name) == shards[name], f"{name} is visible with bytes it was never meant to have"
    pending = catalog.storage.pending_uploads(catalog.storage.path(step_dir(NEW)))
    if new:
        assert not pending, f"step 20 committed with multipart uploads still pending: {pending}"
        return
    tally.pending_after_kill += bool(pending)
    # The torn save is garbage once a newer step commits: GC deletes its directory and
    # aborts what the kill left pending.
    # No directory when killed before the first shard, or when all it left is pending uploads.
    torn = NEW in catalog.all_steps() or bool(pending)
    save_checkpoint(catalog, 30, make_state(30))
    assert catalog.collect_garbage() == ([NEW] if torn else [])
    assert NEW not in catalog.all_steps() and catalog.committed_steps() == [OLD, 30]
    assert not catalog.storage.pending_uploads(catalog.storage.path(step_dir(NEW)))
    tally.aborted_by_gc += bool(pending)


def full_save(fork_server, tmp_path: Path, place: Place, name: str) -> tuple[str, Outcome]:
    url = place.url(name)
    out = run_writer(fork_server, tmp_path, url, place.options, Plan("full", "done", 0.0))
    assert out.done_at is not None
    return url, out


# -- tests ------------------------------------------------------------------------------------

KILLS = [
    pytest.param("file", 50, id="file-50"),
    pytest.param("s3", 8, marks=pytest.mark.s3, id="s3-8"),
    pytest.param("s3", 50, marks=[pytest.mark.s3, pytest.mark.heavy], id="s3-50"),
]


@pytest.mark.parametrize(("kind", "kills"), KILLS)
def test_a_writer_killed_anywhere_never_leaves_a_checkpoint_that_does_not_verify(
        kind, kills, fork_server, request, tmp_path):
    started = time.monotonic()
    place = _place(kind, request, tmp_path)
    # A save that runs to the end: how long step 20 takes, and the bytes of each shard.
    url, full = full_save(fork_server, tmp_path, place, "full")
    catalog = place.catalog(url)
    assert catalog.committed_steps() == [OLD, NEW]
    shards = {name: digest(catalog, NEW, name) for name in shard_objects(catalog, NEW)}
    assert len(shards) == WORLD and catalog.storage.fs.size(catalog.storage.path(step_dir(NEW), BIG_SHARD)) > 3 * PART

    rng = random.Random(f"{SEED}-{kind}-{kills}")
    tally = Tally()
    for i, plan in enumerate(plans(kills, full.done_at, rng, multipart=kind == "s3")):
        url = place.url(f"k{i:02d}")
        out = run_writer(fork_server, tmp_path, url, place.options, plan)
        tally.kinds[plan.kind] += 1
        check_after_kill(place, url, out, shards, tally)

    elapsed = time.monotonic() - started
    print(f"\n{kind}: {kills} kills in {elapsed:.1f} s (a full step-20 save took {full.done_at:.2f} s); "
          f"stages {dict(tally.stages)}; kill kinds {dict(tally.kinds)}; step 20 committed {tally.committed}x; "
          f"killed mid multipart upload {tally.mid_multipart}x; left a pending upload {tally.pending_after_kill}x, "
          f"all aborted by GC ({tally.aborted_by_gc})")
    missed = [s for s in STAGES if not tally.stages[s]]
    assert not missed, f"no kill landed in stage(s) {missed}: {dict(tally.stages)}"
    if kind == "s3":
        assert tally.mid_multipart and tally.pending_after_kill, "no kill landed mid multipart upload"


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_flipped_bit_in_a_committed_shard_is_caught_and_load_falls_back(kind, fork_server, request, tmp_path):
    place = _place(kind, request, tmp_path)
    url, _ = full_save(fork_server, tmp_path, place, "flip")
    catalog = place.catalog(url)
    chunk = catalog.read_manifest(NEW).tensors["model/big"].chunks[0]
    assert chunk.file == BIG_SHARD
    flip_bit(catalog, NEW, BIG_SHARD, offset=chunk.byte_offset + chunk.nbytes // 2 + 5)

    code, out, err = cli("verify", url, *place.cli_options())
    assert code == 1 and f"step {NEW}: CORRUPT" in out and BIG_SHARD in out and BIG_SHARD in err
    assert f"step {OLD}: ok" in out
    with pytest.raises(CorruptCheckpoint, match=BIG_SHARD):
        load_checkpoint(catalog, NEW)
    skipped = []
    assert newest_loadable(catalog, on_fallback=lambda step, err: skipped.append(step)) == OLD
    assert skipped == [NEW]
    assert_state(catalog, OLD)
