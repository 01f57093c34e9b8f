"""bench.torture: the kill-point mix, where a kill landed, the checks after a kill (each must be able to
count a bad checkpoint), and a two-point run on file:// end to end (a real writer process SIGKILLed)."""

from __future__ import annotations

import json
import random

from bench.torture.checks import Tally, check_after_kill, where
from bench.torture.main import kill_points, main
from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.storage import Storage
from tests._checkpoints import flip_bit, save_checkpoint, shard_of
from tests._torn_kills import NEW, OLD, Outcome, digest, shard_objects
from tests._torn_writer import logical_state

OLD_DIR, NEW_DIR = step_dir(OLD), step_dir(NEW)


def test_kill_points_are_seeded_and_spread_over_the_save():
    points = kill_points(50, save_s=0.5, create_window_s=0.002, rng=random.Random(3))
    kinds = [p.kind for p in points]
    assert [kinds.count(k) for k in ("uniform", "commit", "held", "manifest")] == [25, 5, 5, 15]
    assert all(p.hold == p.anchor == "shards_done" for p in points if p.kind == "held")
    assert [(p.kind, p.delay) for p in points] == [
        (p.kind, p.delay) for p in kill_points(50, save_s=0.5, create_window_s=0.002, rng=random.Random(3))]
    assert all(0 <= p.delay <= 0.55 for p in points if p.kind == "uniform")
    assert all(p.anchor == f"manifest_begin {NEW_DIR}" and p.delay <= 0.002 for p in points if p.kind == "manifest")


def test_where_a_kill_landed_is_read_from_the_writers_events():
    shard = ["save_begin", "shard_open shard-r00000.bin"]
    assert where(["save_begin"], committed=False) == "staging"
    assert where(shard, committed=False) == "shard write"
    closed = [*shard, *(f"shard_close shard-r{r:05d}.bin" for r in range(4)), "shards_done"]
    assert where(closed, committed=False) == "commit, before the create"
    assert where([*closed, f"manifest_begin {NEW_DIR}"], committed=True) == "manifest create"
    assert where([*closed, f"manifest_begin {NEW_DIR}", f"manifest_end {NEW_DIR}"], committed=True) == "after commit"


def _catalog(tmp_path) -> Catalog:
    return Catalog(Storage(f"file://{tmp_path}/ckpt/job"))


def test_an_intact_committed_checkpoint_counts_as_intact(tmp_path):
    catalog = _catalog(tmp_path)
    save_checkpoint(catalog, OLD, logical_state(OLD))
    tally = Tally()
    check_after_kill(catalog, Outcome(events=["save_begin"]), {}, tally, "t")
    assert (tally.points, tally.checked, tally.intact, tally.bad) == (1, 1, 1, 0), tally.problems


def test_the_checks_count_what_would_be_bad(tmp_path):
    catalog = _catalog(tmp_path)
    save_checkpoint(catalog, OLD, logical_state(OLD + 1))  # committed, loads, but not what step 10 saved
    save_checkpoint(catalog, NEW, logical_state(OLD))  # committed although its create never began
    tally = Tally()
    check_after_kill(catalog, Outcome(events=["save_begin"]), {}, tally, "t")
    assert tally.bad_loadable == 3 and tally.intact == 0, tally.problems  # step 10, step 20, committed unasked
    shards = {name: digest(catalog, NEW, name) for name in shard_objects(catalog, NEW)}
    flip_bit(catalog, NEW, shard_of(catalog, NEW, "model/big"), offset=200)
    tally = Tally()
    check_after_kill(catalog, Outcome(events=["save_begin", f"manifest_begin {NEW_DIR}"]), shards, tally, "t")
    # Step 20 does not verify, so newest_loadable falls back past the newest committed step; the
    # flipped shard is visible with bytes it was never meant to have.
    assert (tally.committed_broken, tally.bad_loadable, tally.torn_visible) == (1, 2, 1), tally.problems


def test_two_points_on_file_leave_no_bad_checkpoint(tmp_path):
    out = tmp_path / "torture.json"
    assert main(["--points", "2", "--backends", "file", "--no-docs", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["points"] == 2 and sum(row["where"].values()) == 2
    assert row["bad"] == 0 and row["checked"] == row["intact"] >= 2
