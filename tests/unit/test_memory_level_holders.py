"""What the holders of memory snapshots keep, and what the controller's choice believes of it.

Across a shrink the ranks are renumbered, and a rank number of the old generation may never write
again: what the old generation's snapshot left in each process goes once the new generation
completes one of its own, and the controller's per-rank figures start afresh. A holder prunes by
its own view of the newest complete snapshot, which may lag the controller's: the choice asks the
holders what they hold rather than trusting that a live holder still has its shard."""

from __future__ import annotations

from ckpt.held import HeldShards
from ckpt.manifest import step_dir
from orchestrator.controller.memory_level import Snapshot
from tests.unit.test_memory_level import _controller_checkpoints, _held_messages, _level


def _shard(step: int, gen: int, owner: int) -> str:
    return f"{step_dir(step)}/shard-g{gen}-r{owner:05d}.bin"


def test_a_restored_snapshot_of_a_rank_number_that_is_gone_is_freed_after_the_next_complete_one():
    # Generation 0 (4 ranks): this process was rank 2, holding its own shard and rank 3's copy.
    held = HeldShards("job")
    for step in (6, 9):
        for owner in (2, 3):
            held.put(_shard(step, 0, owner), b"x" * 8, 0)
    # Rank 1 is lost with no replacement: ranks 0, 2, 3 become 0, 1, 2, and generation 1 restores step 9.
    restored = [_shard(9, 0, 2), _shard(9, 0, 3)]
    held.keep_only(restored, 1)
    assert held.files() == restored and held.protected == 9
    # Generation 1: this process is rank 1 and keeps rank 2's copies. The restored snapshot stays
    # while it is the newest complete one ...
    for owner in (1, 2):
        held.put(_shard(12, 1, owner), b"y" * 4, 1)
    assert set(restored) <= set(held.files())
    # ... and goes once the new generation completed its own: no owner-3 shard would ever push it out.
    held.protect(12)
    for owner in (1, 2):
        held.put(_shard(15, 1, owner), b"z" * 4, 1)
    assert held.files() == sorted(_shard(s, 1, o) for s in (12, 15) for o in (1, 2))
    assert held.nbytes() == 4 * 4


def test_a_storage_restore_protects_nothing_it_kept():
    held = HeldShards("job")
    held.put(_shard(9, 0, 1), b"x" * 4, 0)
    held.protect(9)
    held.keep_only([], 1)
    assert held.files() == [] and held.protected is None


def test_the_controller_s_held_bytes_by_rank_start_afresh_with_each_generation(tmp_path):
    level = _level(tmp_path, [])
    level.begin(0, 0)
    for message in _held_messages():
        level.on_held(message, 4, 0, {}, lambda samples: {})
    assert set(level.held_bytes) == {0, 1, 2, 3}
    level.begin(1, 12, from_memory=True)  # a shrink to 3 ranks: rank 3 reports no more
    level.on_held(_held_messages(15)[0], 3, 1, {}, lambda samples: {})
    assert level.held_bytes == {0: 100}


def test_a_snapshot_that_completed_after_its_holders_pruned_it_is_not_chosen(tmp_path):
    # Step 3 is complete and protected everywhere. Rank 1's shard of step 6 is held by a1 and a2, but
    # another rank's buddy copy of step 6 is slow: before step 6 completes, rank 1 takes step 9, and
    # both holders, still protecting step 3, keep steps 3 and 9 and drop 6. Then step 6 completes.
    holders = {"a1": HeldShards("job"), "a2": HeldShards("job")}
    for held in holders.values():
        held.put(_shard(3, 0, 1), b"x" * 4, 0)
        held.protect(3)
        held.put(_shard(6, 0, 1), b"y" * 4, 0)
        held.put(_shard(9, 0, 1), b"z" * 4, 0)
        assert _shard(6, 0, 1) not in held.files()
    level, lines = _level(tmp_path, []), []
    level.log = lines.append
    level.newest = Snapshot(step=6, manifest_json="{}", holders={"shard-g0-r00001.bin": ["a1", "a2"]})
    live = {name: name for name in holders}
    assert level.viable(None, live)  # alive, which is all that liveness says
    held = {name: set(h.files()) for name, h in holders.items()}
    # A holder that did not answer in time is left out of `held`: its liveness alone counts for it.
    assert level.viable(None, live, {"a1": held["a1"]})
    assert not level.viable(None, live, held) and level.choose(None, live, held) is None
    assert "memory snapshot of step 6 LOST" in lines[-1] and "pruned by them" in lines[-1]


def test_the_controller_asks_the_holders_before_it_chooses_and_restores_from_storage_when_they_pruned(tmp_path):
    checkpoints, Workers = _controller_checkpoints(tmp_path)

    class Pruned(Workers):
        def held_files(self):
            return {"a": {f"{step_dir(9)}/shard-r00000.bin"}}  # an older snapshot's shard, not step 12's

    assert checkpoints.restore_choice(Pruned(), after_failure=True) == (10, None)
    checkpoints, Workers = _controller_checkpoints(tmp_path / "again")
    step, source = checkpoints.restore_choice(Workers(), after_failure=True)
    assert (step, source.step) == (12, 12)  # still held: chosen
