"""A rank restores one engine at a time, the latest call winning (orchestrator.rank.restore_turns).

The controller gives up on a restore as soon as one rank's call fails and calls `restore` again
(another checkpoint, or storage instead of memory) or forms a new generation; the other ranks'
first calls are still loading. These tests drive the actor's real `restore` on threads, as Ray
runs its calls, with the engine and the loading replaced by fakes that report each piece read
the way ckpt.fetch does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

import orchestrator.rank.state as rank_state
from orchestrator.rank.actor import RankActor
from orchestrator.rank.restore_turns import STUCK_S, RestoreSuperseded, RestoreTurns

PIECES = {7: 500}  # pieces of 10 ms per step loaded: step 7's load (5 s) is the one superseded


class FakeData:
    def __init__(self) -> None:
        self.closed = False

    def close(self, wait: bool = True) -> None:
        self.closed = True


class FakeEngine:
    def __init__(self, dp: int) -> None:
        self.dp, self.data, self.next_step = dp, FakeData(), 0
        self.cycle = self  # as a real engine's (DDP's reducer, the pipeline): freed only by a collection


class Loads:
    """The fakes of build_engine and load_engine_state, and what they saw."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()
        self.alive_at_build: list[int] = []  # engines alive when each new one was built
        self.loading: dict[int, threading.Event] = {}
        self.data: list[FakeData] = []  # each built engine's data cursor
        self.fail_at = fail_at
        self.retrying: int | None = None
        self.meshes: list = []  # the mesh each build was given
        self.stuck_at: int | None = None
        self.unstick = threading.Event()

    def build(self, spec, rank, world_size, dp, mesh=None):
        self.meshes.append(mesh)
        gc.collect()
        self.alive_at_build.append(len(self.live))
        engine = FakeEngine(dp)
        self.live.add(engine)
        self.data.append(engine.data)
        return engine

    def load(self, spec, engine, step, fault_hook=None, storage_setup=None, on_bytes=None, interrupt=None):
        self.loading.setdefault(step, threading.Event()).set()
        if step == self.stuck_at:  # a read that never answers (a hung mount): no check runs meanwhile
            self.unstick.wait(30)
        if step == self.retrying:  # a read the store keeps failing: only its retries' interrupt runs
            for _ in range(500):
                interrupt()
                time.sleep(0.01)
        pieces = PIECES.get(step, 30)
        for piece in range(pieces):
            if piece == 3 and step == self.fail_at:
                raise OSError(f"step {step}: a piece does not read")
            time.sleep(0.01)
            on_bytes(1, pieces)
        engine.next_step = step + 1
        return {}

    def wait_loading(self, step: int) -> None:
        deadline = time.monotonic() + 10
        while not self.loading.get(step, threading.Event()).is_set():
            assert time.monotonic() < deadline, f"the restore of step {step} never started loading"
            time.sleep(0.005)


@pytest.fixture
def loads(monkeypatch) -> Iterator[Loads]:
    fakes = Loads()
    monkeypatch.setattr(rank_state, "build_engine", fakes.build)
    monkeypatch.setattr(rank_state, "load_engine_state", fakes.load)
    # The real reclaim (collect, then freeze): an engine alive at a freeze is never collected, and
    # shows among the live ones at the next build. Unfrozen afterwards, for the tests that follow.
    yield fakes
    gc.unfreeze()
    gc.collect()


def rank_actor() -> RankActor:
    """A RankActor with what `restore` and `leave` use, without Ray or a process group."""
    actor = RankActor.__new__(RankActor)
    actor.spec = SimpleNamespace(resources=SimpleNamespace(gpus_per_rank=0), model=SimpleNamespace(from_hf=None))
    actor.held = SimpleNamespace(keep_only=lambda files, gen: None, fence=lambda gen: None)
    actor.engine, actor._reclaiming, actor.restores, actor._dropped = None, None, RestoreTurns(), []
    actor.mesh = None
    actor._dropping = threading.Lock()
    actor.gen, actor.rank, actor.world_size, actor.raylet_pid, actor.collective_s = 0, 1, 2, os.getppid(), 60.0
    actor.sockets = SimpleNamespace(adding=contextlib.nullcontext, abort=lambda: None)
    actor.store = SimpleNamespace(send=lambda message: None)
    return actor


def in_thread(call) -> tuple[threading.Thread, dict]:
    """Run `call` on a thread, as Ray runs an actor's concurrent calls; keep its result or error's text."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as err:
            out["error"] = (type(err), str(err))  # not the error itself: its traceback holds frames

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_later_restore_supersedes_one_still_loading(loads):
    actor = rank_actor()
    actor.mesh = "the generation's mesh"
    first, first_out = in_thread(lambda: actor.restore(7, dp=2))
    loads.wait_loading(7)
    second, second_out = in_thread(lambda: actor.restore(3, dp=1))
    first.join(10)
    second.join(10)
    assert first_out["error"][0] is RestoreSuperseded, first_out
    assert second_out["result"]["next_step"] == 4
    assert actor.engine.next_step == 4 and actor.engine.dp == 1  # the latest call's engine, not the slower one's
    assert loads.alive_at_build == [0, 0]  # never two engines in the process
    assert loads.data[0].closed and not loads.data[1].closed
    # Both built on the generation's mesh, made once at its join: a retried restore creates no sub-group
    # (a stale one that built groups on some ranks only left the counts apart, and the next groups hung).
    assert loads.meshes == [actor.mesh, actor.mesh] and actor.mesh == "the generation's mesh"


def test_a_new_generation_makes_a_running_restore_stale(loads):
    actor = rank_actor()
    first, first_out = in_thread(lambda: actor.restore(7, dp=2))
    loads.wait_loading(7)
    started = time.monotonic()
    assert actor.leave(wait_s=3.0)  # waits for the stale restore to give up, then drops and freezes
    assert time.monotonic() - started < 3.0  # at its next piece, not at the end of its 5 s load
    first.join(10)
    assert first_out["error"][0] is RestoreSuperseded
    assert actor.engine is None  # it published nothing
    actor.sockets = rank_actor().sockets  # the new generation's process group (join)
    assert actor.restore(5, dp=2)["next_step"] == 6
    assert loads.alive_at_build == [0, 0]


def test_a_restore_stuck_in_a_read_makes_its_rank_unfit_for_the_next_generation(loads):
    # A read that never answers holds the restore's thread and its turn until the process ends:
    # every later restore here would wait out its timeout, recovery after recovery, so `leave`
    # says no and the controller's release replaces the rank (WorkerGroup.leave_all).
    loads.stuck_at = 7
    actor = rank_actor()
    first, first_out = in_thread(lambda: actor.restore(7, dp=2))
    loads.wait_loading(7)
    started = time.monotonic()
    assert actor.leave(wait_s=0.5)  # busy where no check runs, but not for long: not judged (it may be building)
    assert 0.5 <= time.monotonic() - started < 3.0
    actor.restores._progress_at -= STUCK_S  # ... until it has shown no progress for STUCK_S
    assert not actor.leave(wait_s=0.5)
    assert actor.leave() is True  # the join's own leave does not wait and does not judge
    loads.unstick.set()  # the read answers at last: the stale restore gives up, publishing nothing
    first.join(10)
    assert first_out["error"][0] is RestoreSuperseded and actor.engine is None


def test_a_failed_restore_publishes_nothing_and_leaves_no_engine_behind(loads):
    loads.fail_at = 7
    actor = rank_actor()
    with pytest.raises(OSError, match="does not read"):
        actor.restore(7, dp=2)
    assert actor.engine is None and loads.data[0].closed
    assert actor.restore(5, dp=2)["next_step"] == 6
    assert loads.alive_at_build == [0, 0]


def test_a_restore_alone_runs_to_the_end(loads):
    actor = rank_actor()
    assert actor.restore(2, dp=2)["next_step"] == 3
    assert actor.engine.data is loads.data[0] and not actor.engine.data.closed


def test_a_call_gone_stale_while_waiting_for_its_turn_does_not_run():
    turns = RestoreTurns()
    ran: list[int] = []

    def restore(ticket: int) -> None:
        with turns.turn(ticket):
            ran.append(ticket)

    first = turns.begin()
    with turns.turn(first):
        waiting, out = in_thread(lambda: restore(turns.begin()))
        time.sleep(0.05)  # the second call waits for the first's turn
        third = turns.begin()  # and goes stale before its turn comes
    waiting.join(5)
    assert out["error"][0] is RestoreSuperseded and ran == []
    with pytest.raises(RestoreSuperseded, match="superseded by a later one"):
        turns.check(first)
    turns.check(third)


def test_a_restore_stuck_in_a_reads_retries_gives_up_at_a_later_call(loads):
    loads.retrying = 7
    actor = rank_actor()
    first, first_out = in_thread(lambda: actor.restore(7, dp=2))
    loads.wait_loading(7)
    started = time.monotonic()
    assert actor.restore(3, dp=1)["next_step"] == 4
    assert time.monotonic() - started < 3.0  # it waited for the stale one's next retry, not its 5 s
    first.join(10)
    assert first_out["error"][0] is RestoreSuperseded and loads.alive_at_build == [0, 0]


def test_a_restore_made_stale_publishes_nothing_and_the_current_one_publishes():
    turns, published = RestoreTurns(), []
    ticket = turns.begin()
    turns.publish(ticket, lambda: published.append(ticket))
    stale, _ = ticket, turns.supersede()  # a leave came after the restore's last piece
    with pytest.raises(RestoreSuperseded):
        turns.publish(stale, lambda: published.append(stale))
    assert published == [ticket]



def test_a_gpu_rank_without_a_usable_cuda_device_says_what_to_fix(monkeypatch):
    import torch

    from orchestrator.rank.device import require_cuda

    def old_driver():  # what torch says on a node whose driver predates its CUDA
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12020)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", old_driver)
    with pytest.raises(RuntimeError) as refused:
        require_cuda(1)
    words = str(refused.value)
    assert words.startswith("resources.gpus_per_rank = 1, but this rank sees no usable CUDA device (RuntimeError: "
                            "The NVIDIA driver on your system is too old")
    assert "driver release 580 or newer" in words and "CUDA_VISIBLE_DEVICES=" in words
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    require_cuda(1)  # usable: nothing said
