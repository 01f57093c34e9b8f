"""The memory level of checkpointing, without Ray: held shards, reading them from holders, buddies,
and the controller's completion and choice of a snapshot.

Snapshots are written by the real shard writer into per-"process" `HeldShards` (one instance per
simulated rank process) and read back by the real reader through `PeerStorage`, into another
layout; the values must equal the state that was saved, element for element.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckpt.catalog import Catalog
from ckpt.errors import SnapshotUnavailable
from ckpt.held import HeldShards
from ckpt.manifest import Manifest, ShardReceipt, merge_receipts, step_dir
from ckpt.peer_storage import PeerStorage
from ckpt.reader import read_slices
from ckpt.shards import slices_to_write, write_slices
from ckpt.storage import Storage, durable_bytes_read
from orchestrator.cluster.buddies import choose_buddies, survives_any_node_loss
from orchestrator.controller.memory_level import MemoryLevel, Snapshot
from orchestrator.controller.policies import CheckpointIntervalPolicy
from orchestrator.controller.step_log import StepRecord
from orchestrator.spec.job_spec import validate_spec
from orchestrator.wire.messages import CheckpointPlan, SnapshotHeld, decode, encode
from tests._fuzz import fuzz
from trainer.state_slices import TensorSlice

WORLD = 4


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"model/w": torch.randn(8, 6, generator=g), "model/b": torch.randn(6, generator=g),
            "optim/w/exp_avg": torch.randn(8, 6, generator=g)}


def _rank_slices(state: dict, rank: int) -> list[TensorSlice]:
    """Row shards of the matrices over 4 ranks (tp-like), the vector replicated (dp-like)."""
    out = []
    for name, t in state.items():
        shape = tuple(t.shape)
        if t.dim() == 2:
            rows = shape[0] // WORLD
            out.append(TensorSlice(name, t.dtype, shape, (rank * rows, 0), (rows, shape[1]),
                                   tensor=t[rank * rows:(rank + 1) * rows].clone()))
        else:
            out.append(TensorSlice(name, t.dtype, shape, (0,), shape, replica=rank, replicas=WORLD, tensor=t.clone()))
    return out


def _snapshot(step: int = 12):
    """Each rank writes its shard into its own HeldShards and a copy into its buddy's (rank + 1)."""
    state = _state()
    helds = [HeldShards("job") for _ in range(WORLD)]
    receipts, holders = [], {}
    for rank in range(WORLD):
        slices = _rank_slices(state, rank)
        receipt = write_slices(helds[rank].storage, step, rank, slices_to_write(slices), 0.0,
                               held=[s.with_tensor(None) for s in slices], tag="t")
        relpath = f"{step_dir(step)}/{receipt.file}"
        helds[rank].note_written(relpath, 0)
        buddy = (rank + 1) % WORLD
        helds[buddy].put(relpath, helds[rank].read(relpath), 0)
        receipts.append(receipt)
        holders[receipt.file] = [rank, buddy]
    manifest = Manifest(job="job", step=step, generation=0, layout={}, spec_hash="h", created_at=0.0,
                        tensors=merge_receipts(receipts), state={"engine": {}}, total_bytes=0)
    return state, helds, manifest, holders


def _read_whole(state, helds, manifest, holders, reader: int, alive: set[int], step: int = 12):
    def remote(holder, relpath, start, end):
        if holder not in alive:
            raise ConnectionError(f"process {holder} is dead")
        return helds[holder].read_range(relpath, start, end)

    storage = PeerStorage(helds[reader], holders, remote)
    wanted = [TensorSlice(n, t.dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape)) for n, t in state.items()]
    return read_slices(Catalog(storage), step, wanted, manifest=manifest), storage


def test_a_snapshot_reads_back_into_another_layout_from_its_holders():
    state, helds, manifest, holders = _snapshot()
    read_before = durable_bytes_read()
    # One process reads whole tensors (a layout none of the writers had) while ranks 0 and 2 are dead:
    # their shards come from their buddies (1 and 3), so every shard has a live holder.
    got, storage = _read_whole(state, helds, manifest, holders, reader=3, alive={1, 3})
    for piece in got:
        assert torch.equal(piece.tensor, state[piece.name]), piece.name
    assert storage.remote_bytes > 0  # rank 0's shard came from its buddy, rank 1
    assert durable_bytes_read() == read_before  # nothing read from durable storage


def test_a_shard_with_no_live_holder_is_unavailable_not_corrupt():
    state, helds, manifest, holders = _snapshot()
    try:
        _read_whole(state, helds, manifest, holders, reader=3, alive={2, 3})  # rank 0 and its buddy 1 are gone
    except SnapshotUnavailable as err:
        assert "shard-t-r00000.bin" in str(err)
    else:
        raise AssertionError("reading a shard whose holders are all dead must raise SnapshotUnavailable")


def test_held_shards_keep_two_snapshots_per_owner_and_keep_only_what_a_restore_names():
    held = HeldShards("job")
    for step in (3, 6, 9):
        for owner in (0, 1):
            held.put(f"{step_dir(step)}/shard-t-r{owner:05d}.bin", b"x" * (step + owner), 0)
    assert held.files() == sorted(f"{step_dir(s)}/shard-t-r{o:05d}.bin" for s in (6, 9) for o in (0, 1))
    assert held.nbytes() == 6 + 7 + 9 + 10
    held.keep_only([f"{step_dir(9)}/shard-t-r00001.bin"], 1)
    assert held.files() == [f"{step_dir(9)}/shard-t-r00001.bin"]
    assert held.read_range(f"{step_dir(9)}/shard-t-r00001.bin", 2, 5) == b"xxx"
    # An abandoned save's file, whole (memory:// writes it at once) but never noted by its writer, goes at
    # the next restore too, rather than staying in the process for its life.
    orphan = f"{step_dir(12)}/shard-t-r00000.bin"
    held.storage.write_immutable(held.path(orphan), b"o" * 8)
    held.keep_only([f"{step_dir(9)}/shard-t-r00001.bin"], 2)
    assert not held.storage.exists(held.path(orphan)) and held.files() == [f"{step_dir(9)}/shard-t-r00001.bin"]


def test_a_late_shard_of_a_generation_that_ended_is_refused_and_evicts_nothing():
    """A save left to finish when its rank left lands after the next generation restored: it is
    dropped, so its owner's places hold that generation's snapshots (the newest complete one too)."""
    held, restored = HeldShards("job"), f"{step_dir(9)}/shard-g0-r00001.bin"
    held.put(restored, b"r" * 4, 0)
    held.keep_only([restored], 1)  # generation 1 restores step 9
    held.put(f"{step_dir(12)}/shard-g1-r00001.bin", b"n" * 4, 1)  # its first snapshot, complete
    held.protect(12)  # (the rank loop, from the plan that names it)
    assert not held.put(f"{step_dir(15)}/shard-g0-r00001.bin", b"s" * 4, 0)  # the late buddy copy
    late = f"{step_dir(15)}/shard-g0-r00000.bin"
    with held.storage.atomic_writer(held.path(late)) as out:  # the late own write, through the storage
        out.write(b"s" * 4)
    assert not held.note_written(late, 0) and not held.storage.exists(held.path(late))
    assert held.put(f"{step_dir(14)}/shard-g1-r00001.bin", b"b" * 4, 1)  # being built: step 12 must stay
    assert held.files() == [f"{step_dir(s)}/shard-g1-r00001.bin" for s in (12, 14)]


def test_the_fence_rises_when_a_rank_leaves_so_a_late_shard_cannot_push_out_the_snapshot_to_restore():
    # Generation 0 completed step 9 and was building 12 when it ended; a shard of step 15 (also
    # generation 0) lands between the rank's leave and its restore of step 9.
    held, chosen = HeldShards("job"), f"{step_dir(9)}/shard-g0-r00001.bin"
    held.put(chosen, b"c" * 4, 0)
    held.put(f"{step_dir(12)}/shard-g0-r00001.bin", b"p" * 4, 0)
    held.fence(1)  # RankActor.leave of generation 0
    assert not held.put(f"{step_dir(15)}/shard-g0-r00001.bin", b"l" * 4, 0)
    assert chosen in held.files()  # still there for the restore to read


def test_a_long_lived_rank_s_memory_filesystem_holds_only_what_it_keeps():
    """A snapshot every few steps for days: the dropped snapshots' directories go with their files
    (fsspec's memory filesystem keeps a directory until it is removed, and scans its directories on
    every lookup), so the rank's own writes and its buddy copies leave no trail."""
    held = HeldShards("job")
    for step in range(1, 301):
        for owner in (0, 1):
            relpath = f"{step_dir(step)}/shard-t-r{owner:05d}.bin"
            if owner == 0:  # the rank's own writer, through the storage, then noted
                with held.storage.atomic_writer(held.path(relpath)) as out:
                    out.write(b"x" * 4)
                held.note_written(relpath, 0)
            else:  # a buddy's copy
                held.put(relpath, b"y" * 4, 0)
    fs = held.storage.fs
    root = fs._strip_protocol(held.storage.root)
    directories = [d for d in fs.pseudo_dirs if d.startswith(root)]
    assert sorted(directories) == [root] + [fs._strip_protocol(held.path(step_dir(s))) for s in (299, 300)]
    assert [p for p in fs.store if p.startswith(root)] == [fs._strip_protocol(held.path(r)) for r in held.files()]


def test_durable_reads_are_counted_and_memory_reads_are_not(tmp_path):
    durable, memory = Storage(f"file://{tmp_path}"), Storage("memory://undying-test-count")
    for storage in (durable, memory):
        storage.write_immutable(storage.path("f"), b"0123456789")
    before = durable_bytes_read()
    memory.read(memory.path("f"))
    assert durable_bytes_read() == before
    out = memoryview(bytearray(4))
    durable.read_range_into(durable.path("f"), 3, out)
    assert durable_bytes_read() == before + 4 and bytes(out) == b"3456"


@fuzz(200)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12))
def test_losing_any_one_node_never_loses_both_copies(node_ids):
    nodes = [f"n{i}" for i in node_ids]
    buddies = choose_buddies(nodes)
    if len(nodes) == 1:
        assert buddies == [None]
    elif len(set(nodes)) == 1:
        assert buddies == [(r + 1) % len(nodes) for r in range(len(nodes))]  # another process, same node
    else:
        assert survives_any_node_loss(nodes, buddies)
        for lost in set(nodes):  # every shard keeps a copy off the lost node
            assert all(nodes[r] != lost or nodes[b] != lost for r, b in enumerate(buddies))


def test_buddies_spread_over_the_next_node():
    assert choose_buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert choose_buddies(["a", "a", "a", "b"]) == [3, 3, 3, 0]


def test_the_plan_marks_snapshot_steps_but_not_the_final_one_nor_a_stop_step():
    plan = CheckpointPlan(every=10, anchor=4, final_step=20, memory_every=3)
    assert [s for s in range(21) if plan.snapshot_due(s)] == [7, 10, 13, 16, 19]
    assert not any(CheckpointPlan(every=10).snapshot_due(s) for s in range(30))
    stopping = CheckpointPlan(every=10, anchor=4, final_step=20, memory_every=3, stop_at=13)
    assert [s for s in range(21) if stopping.snapshot_due(s)] == [7, 10]


def test_snapshot_message_round_trips():
    receipt = ShardReceipt(step=12, rank=1, file="shard-t-r00001.bin", nbytes=0, tensors={}, blocking_s=0.0,
                           write_s=0.0)
    message = SnapshotHeld(receipt, ["a1", "b2"], {"held_bytes": 5})
    assert decode(encode(message)) == message


def _level(tmp_path, lines: list):
    spec = validate_spec({
        "name": "unit", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
        "train": {"steps": 30, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 4},
        "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 10,
                       "memory": {"enabled": True, "every_steps": 3}}})
    return MemoryLevel(spec, "run", CheckpointIntervalPolicy(spec.checkpoint), lines.append)


def _held_messages(step: int = 12, holders=lambda rank: [f"a{rank}", f"a{(rank + 1) % WORLD}"]):
    state = _state()
    storage = Storage("memory://undying-test-level")
    out = []
    for rank in range(WORLD):
        slices = _rank_slices(state, rank)
        receipt = write_slices(storage, step, rank, slices_to_write(slices), 0.01,
                               held=[s.with_tensor(None) for s in slices], tag="t")
        extra = {"engine": {"next_step": step}} if rank == 0 else {}
        out.append(SnapshotHeld(receipt, holders(rank), dict(extra, held_bytes=100 + rank)))
    return out


def test_a_snapshot_completes_only_when_every_shard_is_held_twice(tmp_path):
    level = _level(tmp_path, [])
    level.begin(0, 0)
    once = _held_messages(holders=lambda rank: [f"a{rank}"])
    assert all(level.on_held(m, WORLD, 0, {}, lambda samples: {}) is None for m in once)
    level.begin(0, 0)
    done = [level.on_held(m, WORLD, 0, {}, lambda samples: {}) for m in _held_messages()]
    assert done[:-1] == [None] * 3 and done[-1].step == 12
    assert level.held_bytes == {0: 100, 1: 101, 2: 102, 3: 103}
    assert level.every([0.1] * 5) == 3


def test_the_choice_prefers_a_surviving_snapshot_and_falls_back_loudly(tmp_path):
    lines: list[str] = []
    level = _level(tmp_path, lines)
    level.begin(0, 0)
    for message in _held_messages():
        level.on_held(message, WORLD, 0, {}, lambda samples: {})
    live = {f"a{r}": f"handle{r}" for r in (1, 2, 3)}  # rank 0's process died; its buddy a1 lives
    assert level.viable(10, live) and not level.viable(20, live)  # storage step 20 is newer
    source = level.choose(10, live)
    assert source.step == 12 and source.holders["shard-t-r00000.bin"] == ["handle1"]
    assert source.manifest().step == 12
    assert level.choose(None, {f"a{r}": r for r in (2, 3)}) is None  # a0 and its buddy a1 both gone
    assert "memory snapshot of step 12 LOST" in lines[-1] and "shard-t-r00000.bin" in lines[-1]
    assert level.choose(10, live) is None  # once lost, never chosen again


def test_a_snapshot_that_failed_to_restore_is_discarded(tmp_path):
    level = _level(tmp_path, [])
    level.begin(0, 0)
    for message in _held_messages():
        level.on_held(message, WORLD, 0, {}, lambda samples: {})
    live = {f"a{r}": r for r in range(WORLD)}
    assert "restoring from storage instead" in level.discard(12, SnapshotUnavailable("gone"))
    assert level.choose(None, live) is None and not level.viable(None, live)


def test_after_a_restore_to_an_older_step_new_snapshots_complete_below_the_lost_one(tmp_path):
    level = _level(tmp_path, [])
    level.begin(0, 0)
    for message in _held_messages(step=24):
        level.on_held(message, WORLD, 0, {}, lambda samples: {})
    level.begin(1, 20)  # restored from storage step 20: the snapshot of step 24 is gone with its holders
    assert level.newest is None
    done = [level.on_held(m, WORLD, 1, {}, lambda samples: {}) for m in _held_messages(step=23)]
    assert done[-1] is not None and level.choose(20, {f"a{r}": r for r in range(WORLD)}).step == 23


def test_a_lost_step_snapshotted_again_is_chosen_and_a_storage_restore_of_its_step_keeps_none(tmp_path):
    level = _level(tmp_path, [])
    level.begin(0, 0)
    for message in _held_messages(step=12):
        level.on_held(message, WORLD, 0, {}, lambda samples: {})
    assert level.choose(None, {}) is None  # every holder gone: step 12 lost
    level.begin(1, 10)  # restored storage step 10; the snapshot cadence brings step 12 round again
    for message in _held_messages(step=12):
        level.on_held(message, WORLD, 1, {}, lambda samples: {})
    live = {f"a{r}": r for r in range(WORLD)}
    assert level.choose(10, live).step == 12  # the new snapshot of 12, not the lost one's verdict
    level.begin(2, 12)  # restored from storage at the same step 12: the ranks dropped what they held
    assert level.newest is None and level.choose(None, live) is None


def test_a_host_memory_limit_below_the_level_s_need_is_refused_naming_the_field(tmp_path):
    import pytest

    from orchestrator.spec.memory_check import SHARES, snapshot_share_bytes
    from orchestrator.spec.problems import SpecError

    data = {"name": "unit", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 30, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 2},
            "checkpoint": {"url": f"file://{tmp_path}/ckpt", "memory": {"enabled": True}}}
    share = snapshot_share_bytes(validate_spec(data))
    data["checkpoint"]["memory"]["max_host_bytes"] = SHARES * share - 1
    with pytest.raises(SpecError, match=r"checkpoint\.memory\.max_host_bytes.*raise the limit"):
        validate_spec(data)
    data["checkpoint"]["memory"]["max_host_bytes"] = SHARES * share
    assert validate_spec(data).checkpoint.memory.max_host_bytes == SHARES * share


def test_the_report_books_restore_and_lost_work_per_level():
    from monitor.report import FailureRecord, _by_level

    failures = [FailureRecord(time=1.0, kind="kill_rank", restore_level="memory", storage_read_bytes=0, restore_s=0.25,
                              lost_work_s=0.5),
                FailureRecord(time=2.0, kind="kill_node", restore_level="storage", storage_read_bytes=10,
                              restore_s=1.5, lost_work_s=2.0),
                FailureRecord(time=3.0, kind="kill_rank", restore_level="memory", restore_s=0.25, lost_work_s=0.5),
                FailureRecord(time=4.0, kind="hang")]
    assert _by_level(failures) == " (memory 2: restore 0.5 s, lost 1.0 s; storage 1: restore 1.5 s, lost 2.0 s)"
    assert _by_level(failures[3:]) == ""


def test_a_memory_anchor_of_its_own_moves_the_snapshots_and_not_the_saves():
    plan = CheckpointPlan(every=10, anchor=0, final_step=40, memory_every=7, memory_anchor=23)
    assert [s for s in range(41) if plan.should_save(s)] == [10, 20, 30, 40]
    assert [s for s in range(41) if plan.snapshot_due(s)] == [30, 37]


class _PlanStore:
    def __init__(self):
        self.plans: list[CheckpointPlan] = []

    def set_plan(self, data: dict) -> None:
        self.plans.append(CheckpointPlan.from_json(data))


def _checkpoints(tmp_path, name: str = "grid"):
    """The controller's Checkpoints of a dp-2, 40-step job saving every 10 steps, the memory level on
    (the default); with its JobRecord."""
    from monitor.goodput import GoodputLedger
    from monitor.metrics import JobMetrics
    from orchestrator.controller.checkpoints import Checkpoints
    from orchestrator.controller.faults import ControllerFaults
    from orchestrator.controller.job_record import JobRecord

    spec = validate_spec({"name": name, "model": {"preset": "tiny"}, "data": {"seq_len": 16},
                          "train": {"steps": 40, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 2},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 10}})
    assert spec.checkpoint.memory.enabled  # the default
    ledger, metrics = GoodputLedger(), JobMetrics(name)
    record = JobRecord(spec.name, spec.train.steps, metrics, ledger)
    catalog = Catalog(Storage(spec.checkpoint_root))
    chaos = ControllerFaults([], catalog, 0, ledger.wall, printer=lambda line: None)
    return Checkpoints(spec, catalog, ledger, record, metrics, chaos, log=lambda line: None), record


def _planning_checkpoints(tmp_path):
    """`_checkpoints` begun at step 0, with a store that records each published plan."""
    checkpoints, record = _checkpoints(tmp_path)
    store = _PlanStore()
    checkpoints.begin(store, 0, None)
    return checkpoints, store, record


def test_storage_saves_keep_their_steps_through_memory_replans_and_memory_restores(tmp_path):
    """every_steps: 10 saves at 10, 20, 30 however the memory cadence moves and whichever level restores."""
    checkpoints, store, record = _planning_checkpoints(tmp_path)
    for s in range(13):  # the controller is at step 13
        record.steps.put(StepRecord(s, 1.0, 100, 0.1, 0.0))
    record.last_step = 12
    checkpoints.memory.every = lambda times: 4
    checkpoints._replan()
    moved = store.plans[-1]
    assert (moved.every, moved.anchor, moved.memory_every) == (10, 0, 4) and moved.memory_anchor > 13
    assert [s for s in range(41) if moved.should_save(s)] == [10, 20, 30, 40]
    # A restore from a memory snapshot of step 23: the snapshots start there, the saves stay at 30, 40.
    checkpoints.memory.samples_of = lambda step: {}
    checkpoints.begin(store, 1, 23, source=Snapshot(step=23, manifest_json="", holders={}))
    restored = store.plans[-1]
    assert [s for s in range(24, 41) if restored.should_save(s)] == [30, 40]
    assert [s for s in range(24, 41) if restored.snapshot_due(s)] == [27, 31, 35, 39]
    # A restore from storage anchors both at the restored step, as before.
    checkpoints.begin(store, 2, 20)
    assert store.plans[-1].anchor == 20 and store.plans[-1].memory_anchor == 20


def _controller_checkpoints(tmp_path):
    """The controller's Checkpoints of a dp-2 job, storage's newest commit step 10, a memory snapshot of
    step 12 held by the live actor "a"; with the Workers whose live actors it sees."""
    checkpoints, _ = _checkpoints(tmp_path, "snap")
    checkpoints.restore.restore_point = lambda: 10  # storage's newest commit
    checkpoints.memory.newest = Snapshot(step=12, manifest_json="{}", holders={"shard-r00000.bin": ["a"]})

    class Workers:
        def live_actors(self):
            return {"a": object()}

        def held_files(self):
            return {"a": {f"{step_dir(12)}/shard-r00000.bin"}}

    return checkpoints, Workers


def test_a_corrupt_memory_snapshot_is_discarded_and_the_stored_checkpoint_not_suspected(tmp_path):
    """A snapshot whose held copy fails its checksum at restore: the next choice is storage, and the
    stored step (never read) is neither quarantined nor skipped."""
    from ckpt.errors import CorruptCheckpoint

    checkpoints, Workers = _controller_checkpoints(tmp_path)
    step, source = checkpoints.restore_choice(Workers(), after_failure=True)
    assert (step, source.step) == (12, 12)
    line = checkpoints.on_unloadable(step, source, CorruptCheckpoint("block 3 of shard-r00000.bin: crc mismatch"))
    assert "memory snapshot of step 12 could not be restored" in line and "restoring from storage" in line
    assert checkpoints.restore_choice(Workers(), after_failure=True) == (10, None)
    assert checkpoints.restore.bad == {}


def test_a_snapshot_is_chosen_without_asking_a_failing_store_and_never_one_older_than_a_commit(tmp_path):
    from ckpt.storage_errors import TransientStorageError

    checkpoints, Workers = _controller_checkpoints(tmp_path)

    def store_down():
        raise TransientStorageError("listing the committed checkpoints: the store failed for 120 s")

    checkpoints.restore.restore_point = store_down
    checkpoints.committer.latest = 10
    step, source = checkpoints.restore_choice(Workers(), after_failure=True)
    assert (step, source.step) == (12, 12)  # the outage costs the memory restore nothing
    checkpoints.committer.latest = 14  # this run committed a newer step since: storage restores it
    checkpoints.restore.restore_point = lambda: 14
    assert checkpoints.restore_choice(Workers(), after_failure=True) == (14, None)
    checkpoints.committer.latest = 10
    assert checkpoints.restore_choice(Workers(), after_failure=False) == (14, None)  # on purpose: storage


def test_a_create_held_by_the_store_holds_no_restore_from_a_newer_snapshot_and_an_older_one_waits_for_it(
        tmp_path):
    checkpoints, Workers = _controller_checkpoints(tmp_path)
    checkpoints.committer.latest, waits = 10, []
    checkpoints.committer.committing = {11: object()}  # step 11's manifest create, held by a hung store

    def flush(timeout_s):
        waits.append(timeout_s)
        return True

    checkpoints.committer.flush = flush
    assert checkpoints.expected_restore_point(Workers()) == 12
    step, source = checkpoints.restore_choice(Workers(), after_failure=True)
    assert (step, source.step) == (12, 12) and waits == []  # the snapshot is newer: the create is not waited for
    checkpoints.committer.committing = {14: object()}  # newer than the snapshot: the restore must see it land
    checkpoints.expected_restore_point(Workers())
    assert waits


def test_a_restore_from_memory_that_fails_otherwise_is_not_tried_again(tmp_path):
    # A holder that never answers: the restore runs into its time limit, not a checksum; the recovery
    # after it must not pick the same snapshot (and the same silent holder) again and again.
    checkpoints, Workers = _controller_checkpoints(tmp_path)
    step, source = checkpoints.restore_choice(Workers(), after_failure=True)
    assert source is not None and step == 12
    checkpoints.on_restore_failed(source, TimeoutError("the ranks' restore took longer than 190 s"))
    assert checkpoints.restore_choice(Workers(), after_failure=True) == (10, None)
    checkpoints.on_restore_failed(None, TimeoutError("a storage restore's"))  # nothing of memory to forget
    assert checkpoints.restore.bad == {}


def test_a_holder_keeps_the_newest_complete_snapshot_while_newer_ones_are_still_copied():
    # Rank 0 wrote steps 6 and 9 while step 6's buddy copies of other ranks lag: the controller's
    # newest complete snapshot is step 3, which a restore would choose; the plan names it.
    held = HeldShards("job")
    held.protect(3)
    for step in (3, 6, 9):
        held.put(f"{step_dir(step)}/shard-t-r00000.bin", b"x", 0)
    # Still two per owner (the memory budget's): the protected one and the newest; 6, between, gives way.
    assert [f.split("/")[0] for f in held.files()] == [step_dir(s) for s in (3, 9)]
    held.protect(9)  # step 9 became complete: step 3 goes at the next arrival
    held.put(f"{step_dir(12)}/shard-t-r00000.bin", b"x", 0)
    assert [f.split("/")[0] for f in held.files()] == [step_dir(s) for s in (9, 12)]


def test_a_completed_snapshot_republishes_the_plan_naming_it_with_the_same_cadence(tmp_path):
    checkpoints, store, _ = _planning_checkpoints(tmp_path)
    first = store.plans[-1]
    assert first.memory_complete is None

    def completes(message, world_size, gen, layout, extra_state):
        checkpoints.memory.newest = Snapshot(step=8, manifest_json="", holders={})
        return checkpoints.memory.newest

    checkpoints.memory.on_held = completes
    checkpoints.on_snapshot(_held_messages(8)[0], 2, {}, 0)
    named = store.plans[-1]
    assert named.memory_complete == 8 and named.version > first.version
    assert (named.every, named.anchor, named.memory_every, named.memory_anchor) == \
        (first.every, first.anchor, first.memory_every, first.memory_anchor)


def test_snapshots_that_never_complete_are_given_up_past_a_few_not_kept_for_the_generation(tmp_path):
    # Rank 3's buddy copy keeps failing: its shard is never held twice, so no snapshot completes;
    # the others' shards of every snapshot step must not pile up for the whole generation.
    lines: list[str] = []
    level = _level(tmp_path, lines)
    level.begin(0, 0)
    steps = list(range(3, 3 * 9, 3))
    for step in steps:
        for message in _held_messages(step, holders=lambda rank: [f"a{rank}"] if rank == 3 else
                                      [f"a{rank}", f"a{rank + 1}"]):
            assert level.on_held(message, WORLD, 0, {}, lambda samples: {}) is None
    assert sorted(level._holders) == steps[-3:] and sorted(level.committer.pending) == steps[-3:]
    assert level.incomplete == len(steps) - 3 and len(lines) == 1 and "step 3 never completed" in lines[0]
    done = [level.on_held(m, WORLD, 0, {}, lambda samples: {}) for m in _held_messages(30)]
    assert done[-1].step == 30 and level.newest_step() == 30  # the copy works again: the next one completes


def test_a_grow_that_re_forms_at_a_commit_forgets_a_newer_snapshot(tmp_path):
    """The grow booked the steps past its commit as lost work; were its re-formation to fail and recover,
    a snapshot newer than the commit must not be restored as if they had been kept."""
    level = _level(tmp_path, [])
    level.newest = Snapshot(step=104, manifest_json="{}", holders={})
    level.forget_newer(110)
    assert level.newest_step() == 104  # not newer than the re-formation's commit: kept
    level.forget_newer(100)
    assert level.newest is None


def test_a_storage_restore_forgets_the_snapshot_the_ranks_drop_as_it_begins(tmp_path):
    # A grow re-forms at commit 12 with a snapshot of step 12 held: the ranks drop it at that storage
    # restore, so when the restore fails the recovery after it must not try the snapshot.
    checkpoints, Workers = _controller_checkpoints(tmp_path)
    checkpoints.restore.restore_point = lambda: 12
    assert checkpoints.restore_choice(Workers(), after_failure=False) == (12, None)
    checkpoints.on_restore_failed(None, RuntimeError("rank 1 died during the restore"))
    assert checkpoints.restore_choice(Workers(), after_failure=True) == (12, None)


def test_a_snapshots_blocking_is_booked_as_its_shards_come_in_whether_or_not_it_completes(tmp_path):
    # Rank 3's buddy copy fails: step 12's snapshot never completes, yet every rank stopped to stage it.
    from monitor.goodput import GoodputLedger

    checkpoints, store, _ = _planning_checkpoints(tmp_path)
    now, blocked = [0.0], []
    checkpoints.ledger = ledger = GoodputLedger(clock=lambda: now[0])
    checkpoints.record.on_save_blocking = lambda step, seconds: blocked.append((step, seconds))
    ledger.enter("productive")
    now[0] = 100.0  # plenty of productive time to move from
    for message in _held_messages(12, holders=lambda rank: [f"a{rank}"] if rank == 3 else [f"a{rank}", f"a{rank + 1}"]):
        message.receipt.blocking_s = 0.5 + message.receipt.rank * 0.1  # the slowest rank: 0.8 s
        checkpoints.on_snapshot(message, WORLD, {}, 0)
    assert checkpoints.memory.newest is None  # never complete
    assert sum(seconds for _, seconds in blocked) == pytest.approx(0.8) and {s for s, _ in blocked} == {12}
    assert ledger.totals()["checkpoint_save"] == pytest.approx(0.8)
