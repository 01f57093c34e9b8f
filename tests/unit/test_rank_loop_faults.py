"""A rank's loop with a real one-rank engine and a real store: nan_grad stops it, storage faults hit its
shard writes only, and events from the writer thread travel on the writer's own store client."""

from __future__ import annotations

import threading
import time

import pytest

from chaos.config import ArmedFault
from ckpt.manifest import step_dir
from orchestrator.rank.loop import NonFiniteGradient, RankLoop, _EventSink
from orchestrator.rank.state import build_engine
from orchestrator.spec.job_spec import validate_spec
from orchestrator.wire.messages import SaveFailed
from orchestrator.wire.store import PLAN, RendezvousServer, connect


def _spec(tmp_path, faults, **sections):
    # Two ranks in the spec, so that faults may name rank 1; the loop under test plays rank 0 alone.
    return validate_spec({
        "name": "loop", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
        "train": {"steps": 6, "global_batch": 2, "micro_batch": 1}, "parallel": {"dp": 2},
        "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 2}, "chaos": {"faults": faults},
        **sections,
    })


def _run(tmp_path, faults, sections=None, abort=None, **plan):
    """Run rank 0 of a one-rank job to step 6 (saves after steps 2, 4, 6); returns (outcome, events)."""
    spec = _spec(tmp_path, faults, **(sections or {}))
    server = plan.pop("_server", None) or RendezvousServer("127.0.0.1")
    controller = server.generation(0)
    controller.set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                               "job_started_at": time.time(), **plan})
    armed = [ArmedFault.of(f, i) for i, f in enumerate(spec.chaos.faults)]
    loop = RankLoop(spec, build_engine(spec, 0, 1, 1), connect(server.address, 0), 0, 1, abort or threading.Event(),
                    writer_store=connect(server.address, 0))
    try:
        outcome = loop.run(6, armed)
    except NonFiniteGradient as err:
        outcome = err
    return outcome, controller.drain_events(), spec


def test_nan_grad_stops_the_rank_before_the_poisoned_step_is_reported_or_saved(tmp_path):
    outcome, events, _ = _run(tmp_path, [{"kind": "nan_grad", "rank": 0, "at_step": 3}])
    assert isinstance(outcome, NonFiniteGradient) and "non-finite gradient norm at step 3" in str(outcome)
    assert [(e["kind"], e["step"]) for e in events if e["type"] == "fault"] == [("nan_grad", 3)]
    assert [e["step"] for e in events if e["type"] == "step"] == [0, 1, 2]
    assert [e["receipt"]["step"] for e in events if e["type"] == "receipt"] == [2]


@pytest.mark.parametrize("kind", ["storage_error", "torn_write"])
def test_a_storage_fault_on_the_rank_fails_that_shard_write_only(tmp_path, kind):
    outcome, events, spec = _run(tmp_path, [{"kind": kind, "rank": 0, "at_step": 4}])
    assert outcome["status"] == "done"
    [error] = [e for e in events if e["type"] == "save_error"]
    assert error["step"] == 4 and f"injected {kind}" in error["error"]
    [fault] = [e for e in events if e["type"] == "fault"]
    assert fault["kind"] == kind and fault["rank"] == 0 and step_dir(4) in fault["path"]
    assert [e["receipt"]["step"] for e in events if e["type"] == "receipt"] == [2, 6]


@pytest.mark.parametrize("stop_at", [3, 0])
def test_a_stop_step_is_saved_and_ends_the_train_call_there(tmp_path, stop_at):
    # 3: off the cadence; 0: already passed when read (read late), so the step reached (1) is saved.
    outcome, events, _ = _run(tmp_path, [], stop_at=stop_at)
    end = max(stop_at, 1)
    assert outcome["status"] == "done" and outcome["step"] == end
    assert [e["step"] for e in events if e["type"] == "step"] == list(range(end))
    assert [e["receipt"]["step"] for e in events if e["type"] == "receipt"] == [s for s in (2, end) if s <= end]


def test_a_storage_fault_for_another_rank_changes_nothing_here(tmp_path):
    outcome, events, _ = _run(tmp_path, [{"kind": "storage_error", "rank": 1, "at_step": 4},
                                         {"kind": "storage_error", "at_step": 4}])  # the controller's
    assert outcome["status"] == "done"
    assert [e["receipt"]["step"] for e in events if e["type"] == "receipt"] == [2, 4, 6]
    assert not [e for e in events if e["type"] in ("fault", "save_error")]


def _slow_save_of_step_2(tmp_path, delay_s: float, async_save: bool) -> tuple[list, dict]:
    """`_run`'s faults and sections: rank 0's shard writes of step 2 take `delay_s` longer, heartbeats
    every 0.1 s, saves every 2 steps (async or not)."""
    slow = {"kind": "storage_latency", "op": "write", "path": "*/shard-*", "rank": 0, "at_step": 2,
            "delay_s": delay_s}
    return [slow], {"monitor": {"heartbeat_s": 0.1, "port": 0},
                    "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 2, "async": async_save}}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_blocked_on_its_first_save_beats_with_the_bytes_written(tmp_path, async_save):
    """The save of step 2 (the first of the call) takes 1.5 s in the store: the rank beats meanwhile
    with `saving` 2 and its bytes (a synchronous save waits inside the save, an async one behind it
    at the next save or at the end)."""
    from orchestrator.wire.messages import Heartbeat
    from orchestrator.wire.store import heartbeat_key

    server, seen, done = RendezvousServer("127.0.0.1"), [], threading.Event()
    reader = connect(server.address, 0)

    def watch() -> None:
        while not done.is_set():
            beat = reader.get_json(heartbeat_key(0))
            if beat is not None:
                seen.append(Heartbeat.from_json(beat))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        outcome, events, _ = _run(tmp_path, *_slow_save_of_step_2(tmp_path, 1.5, async_save), _server=server)
    finally:
        done.set()
        watcher.join()
    assert outcome["status"] == "done"
    blocked = [b for b in seen if b.saving is not None]
    # Synchronous: blocked in the save of 2 itself; async: at the save of 4, behind the one of 2.
    assert blocked and blocked[0].saving == (4 if async_save else 2) and max(b.saved_bytes for b in blocked) > 0


@pytest.mark.parametrize("async_save", [False, True])
def test_an_abort_behind_a_slow_save_leaves_within_the_settle_time_not_the_save_s(tmp_path, async_save):
    """The save of step 2 takes 10 s in the store; the controller aborts once the rank is blocked on
    it: the rank is out within ABORT_SETTLE_S and change, where waiting for the save would outlast
    the controller's release limit (3 s at least) and get it killed as hung."""
    from orchestrator.rank.loop import ABORT_SETTLE_S
    from orchestrator.wire.messages import Heartbeat
    from orchestrator.wire.store import heartbeat_key

    server, abort, aborted_at = RendezvousServer("127.0.0.1"), threading.Event(), []
    reader = connect(server.address, 0)

    def abort_once_blocked() -> None:
        while not abort.is_set():
            beat = reader.get_json(heartbeat_key(0))
            if beat is not None and Heartbeat.from_json(beat).saving is not None:
                aborted_at.append(time.monotonic())
                abort.set()
            time.sleep(0.05)

    watcher = threading.Thread(target=abort_once_blocked, daemon=True)
    watcher.start()
    outcome, events, _ = _run(tmp_path, *_slow_save_of_step_2(tmp_path, 10, async_save), abort=abort, _server=server)
    left_at = time.monotonic()
    watcher.join()
    assert outcome["status"] == "aborted" and outcome["step"] == (4 if async_save else 2)
    assert left_at - aborted_at[0] < ABORT_SETTLE_S + 1.5
    assert not [e for e in events if e["type"] == "receipt"]  # the slow save had not landed


class _ListStore:
    def __init__(self):
        self.events = []

    def send(self, message):
        self.events.append(message)


def test_events_from_another_thread_use_the_writer_client():
    store, writer = _ListStore(), _ListStore()
    sink = _EventSink(store, writer)
    first, second = SaveFailed(0, 1, "e1"), SaveFailed(0, 2, "e2")
    sink.push(first)
    thread = threading.Thread(target=sink.push, args=(second,))
    thread.start()
    thread.join()
    assert store.events == [first] and writer.events == [second]


def test_an_abort_during_a_validation_leaves_between_its_microbatches(tmp_path):
    """A validation of many windows outlasts the controller's release limit (a step's time): the rank
    looks at the abort before each of its microbatches, as it does between steps."""
    import numpy as np

    from tests._tokens import write_token_dataset

    write_token_dataset(tmp_path / "val", np.arange(4000) % 200, 256)
    abort, forwards = threading.Event(), []
    spec = _spec(tmp_path, [], eval={"path": str(tmp_path / "val"), "every_steps": 2, "windows": 16})
    server = RendezvousServer("127.0.0.1")
    server.generation(0).set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                                         "job_started_at": time.time()})
    engine = build_engine(spec, 0, 1, 1)
    loop = RankLoop(spec, engine, connect(server.address, 0), 0, 1, abort, writer_store=connect(server.address, 0))
    model_forward = engine.model.forward

    def forward(*args, **kwargs):  # the controller aborts during the first validation's first microbatch
        if not engine.model.training:
            forwards.append(1)
            abort.set()
        return model_forward(*args, **kwargs)

    engine.model.forward = forward
    outcome = loop.run(6, [])
    assert outcome["status"] == "aborted" and outcome["step"] == 2
    assert forwards == [1] and engine.model.training  # one of the 16 windows' microbatches, then out


def test_a_validation_owed_at_the_restored_step_runs_before_the_first_step(tmp_path):
    """`eval_at` (the controller's JobRecord.eval_owed): the restored model's validation that the last
    generation never reported is evaluated first, on the restored weights; at the last step it is all."""
    import numpy as np

    from tests._tokens import write_token_dataset

    write_token_dataset(tmp_path / "val", np.arange(4000) % 200, 256)
    spec = _spec(tmp_path, [], eval={"path": str(tmp_path / "val"), "every_steps": 2, "windows": 4})
    server = RendezvousServer("127.0.0.1")
    controller = server.generation(0)
    controller.set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                               "job_started_at": time.time()})
    engine = build_engine(spec, 0, 1, 1)
    engine.next_step = 6  # as restored from the final checkpoint
    loop = RankLoop(spec, engine, connect(server.address, 0), 0, 1, threading.Event(),
                    writer_store=connect(server.address, 0))
    assert loop.run(6, [], eval_at=6)["status"] == "done"
    assert [(e["type"], e["step"]) for e in controller.drain_events() if e["type"] in ("eval", "step")] == [("eval", 6)]


def test_a_finished_generation_s_writers_are_garbage_once_its_loop_is_gone(tmp_path):
    """The actor hands weak references to a generation's writers to the collection that freezes
    (orchestrator.rank.reclaim): a writer still flushing after an abort blocks the freeze, so one that
    finished must become garbage, or no collection would ever freeze again."""
    import gc
    import weakref

    spec = _spec(tmp_path, [])
    server = RendezvousServer("127.0.0.1")
    server.generation(0).set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                                         "job_started_at": time.time()})
    loop = RankLoop(spec, build_engine(spec, 0, 1, 1), connect(server.address, 0), 0, 1, threading.Event(),
                    writer_store=connect(server.address, 0))
    assert loop.run(6, [])["status"] == "done"
    writers = [weakref.ref(w) for w in loop.writers]
    del loop
    gc.collect()
    assert writers and all(ref() is None for ref in writers)


def test_a_ranks_error_line_keeps_its_cause_and_the_words_past_the_first_line():
    from orchestrator.rank.actor import error_line

    try:
        try:
            raise OSError("No space left on device")
        except OSError as disk:
            nccl = "NCCL error in: ProcessGroupNCCL.cpp:1\n" + "x" * 400 + "\nLast error: peer gone"
            raise RuntimeError(nccl) from disk
    except RuntimeError as err:
        line = error_line(err)
    assert "\n" not in line and "Last error: peer gone" in line
    assert line.endswith("<- caused by OSError: No space left on device")
    assert len(error_line(RuntimeError("y" * 5000))) == 1000


def test_a_failing_step_releases_the_peers_before_it_settles_its_save(tmp_path, monkeypatch):
    # The peers may be blocked in a collective with this rank: they are freed first, then the save in
    # flight gets its settle time (up to a second), not the other way round.
    from orchestrator.rank import loop as rank_loop

    order = []
    real = rank_loop.abandon_stragglers
    monkeypatch.setattr(rank_loop, "abandon_stragglers", lambda writers, s: (order.append("settle"), real(writers, s)))
    spec = _spec(tmp_path, [{"kind": "nan_grad", "rank": 0, "at_step": 3}])
    server = RendezvousServer("127.0.0.1")
    server.generation(0).set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                                         "job_started_at": time.time()})
    loop = RankLoop(spec, build_engine(spec, 0, 1, 1), connect(server.address, 0), 0, 1, threading.Event(),
                    writer_store=connect(server.address, 0), release_peers=lambda: order.append("release"))
    with pytest.raises(NonFiniteGradient):
        loop.run(6, [ArmedFault.of(f, i) for i, f in enumerate(spec.chaos.faults)])
    assert order == ["release", "settle"]


def test_a_stop_does_not_wait_for_an_older_snapshot_s_copy_to_its_buddy(tmp_path):
    # A snapshot taken before the stop step is still being copied to its buddy (up to a minute): the
    # stop's save lands and the call returns within the settle time, the copy given up (never chosen
    # over the stop's commit, which is newer).
    from types import SimpleNamespace

    class CopyingToItsBuddy:
        rank, written_bytes, on_wait, wait_tick_s, abandoned = 0, 0, None, 1.0, False

        def __init__(self):
            self.copied = threading.Event()

        def flush(self):
            self.copied.wait(60)

        def abandon(self):
            self.abandoned = True
            self.copied.set()

    copying = CopyingToItsBuddy()
    spec = _spec(tmp_path, [])
    server = RendezvousServer("127.0.0.1")
    server.generation(0).set_json(PLAN, {"every": 2, "anchor": 0, "version": 1, "final_step": 6, "tag": "t",
                                         "job_started_at": time.time(), "stop_at": 3})
    snapshots = SimpleNamespace(writer=copying, held=SimpleNamespace(protect=lambda step: None))
    loop = RankLoop(spec, build_engine(spec, 0, 1, 1), connect(server.address, 0), 0, 1, threading.Event(),
                    writer_store=connect(server.address, 0), snapshots=lambda tag: snapshots)
    started = time.monotonic()
    outcome = loop.run(6, [])
    assert outcome["status"] == "done" and outcome["step"] == 3 and copying.abandoned
    assert time.monotonic() - started < 30.0
    receipts = [e["receipt"]["step"] for e in server.generation(0).drain_events() if e["type"] == "receipt"]
    assert receipts == [2, 3]
