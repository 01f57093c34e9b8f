"""The "during_restore" fault point: a restoring rank reaches it with the checkpoint's slices read and
not yet loaded, once per restore, and a fault there leaves the engine's step and optimizer unrestored.
The parameters are read straight into the rank's live tensors (no second copy of its share)."""

from __future__ import annotations

import time

import pytest
import torch

from chaos.injector import FaultInjector, InjectedFault
from ckpt.storage import Storage
from orchestrator.rank.state import load_engine_state
from orchestrator.wire.store import RendezvousServer
from tests._checkpoints import commit_trained_engine, tiny_engine
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A committed checkpoint of step 2 of the tiny engine; the spec stand-in the rank glue reads."""
    spec, _ = commit_trained_engine(f"file://{tmp_path_factory.mktemp('restore')}/job")
    return spec


def test_the_point_fires_once_with_the_slices_read_and_not_loaded(saved):
    engine, seen = tiny_engine(), []
    hook = lambda point, step: seen.append((point, step, engine.next_step))  # noqa: E731
    assert load_engine_state(saved, engine, 2, fault_hook=hook)["engine"]["next_step"] == 2
    assert seen == [("during_restore", 2, 0)] and engine.next_step == 2


def test_a_fault_at_the_point_interrupts_the_restore(saved):
    engine, notices = tiny_engine(), []
    hook = FaultInjector.hook_for([{"id": 4, "kind": "raise", "rank": 0, "at_step": 2, "at_point": "during_restore",
                                    "message": "restore interrupted"}], 0, notices.append)
    with pytest.raises(InjectedFault, match="restore interrupted"):
        load_engine_state(saved, engine, 2, fault_hook=hook)
    assert engine.next_step == 0 and [(n["fault_id"], n["point"], n["step"]) for n in notices] == [
        (4, "during_restore", 2)]
    # A fault for another checkpoint's restore stays quiet.
    other = FaultInjector.hook_for([{"id": 5, "kind": "raise", "rank": 0, "at_step": 9, "at_point": "during_restore"}],
                                   0, notices.append)
    assert load_engine_state(saved, engine, 2, fault_hook=other)["engine"]["next_step"] == 2 and len(notices) == 1


class RestoreKiller(FakeWorkerGroup):
    """Rank 1 dies in its restore while a during_restore fault of the restored step is armed for it,
    reporting the fault first, as the rank's injector does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.restores: list[int | None] = []

    def restore_all(self, step, dp, timeout_s, faults=None):
        self.restores.append(step)
        armed = [f for f in faults or [] if f.at_point == "during_restore" and f.at_step in (None, step)]
        if step is not None and armed:
            self.rendezvous.generation(self.gen).push_event({
                "type": "fault", "fault_id": armed[0].id, "kind": armed[0].kind, "rank": 1, "step": step,
                "point": "during_restore", "time": time.time()})
            self.actors.pop(1)
            raise RuntimeError("The actor died unexpectedly before finishing this task")
        return super().restore_all(step, dp, timeout_s, faults)


def test_a_rank_killed_in_its_restore_is_blamed_disarmed_and_replaced(tmp_path):
    spec = _spec(tmp_path, elastic={"max_restarts": 3},
                 chaos={"faults": [{"kind": "kill_rank", "rank": 1, "at_step": 20, "at_point": "during_restore"}]})
    rendezvous = RendezvousServer("127.0.0.1")
    workers = RestoreKiller(rendezvous, Storage(spec.checkpoint_root), die_at={25: 1})
    report = _controller(spec, workers, rendezvous, []).run()
    assert report.status == "succeeded", report.error
    assert workers.restores == [None, 20, 20]  # the fault fired in the first restore of step 20, once
    assert [(f.kind, f.rank) for f in report.failures] == [("rank_died", 1), ("kill_rank", 1)]
    assert report.failures[1].detected_after_s is not None
    assert [p.step for p in report.losses] == list(range(30))


def test_the_parameters_are_read_into_the_rank_s_live_tensors(saved, monkeypatch):
    from ckpt.reader import load_checkpoint
    from orchestrator.rank.state import catalog_for

    engine, seen = tiny_engine(), {}
    live = {p.name: p.tensor.data_ptr() for p in engine.state_slices(copy=False) if p.name.startswith("model/")}
    load_slices = engine.load_slices
    monkeypatch.setattr(engine, "load_slices", lambda slices, meta: (
        seen.update({s.name: s.tensor.data_ptr() for s in slices}), load_slices(slices, meta)))
    load_engine_state(saved, engine, 2)
    assert live and all(seen[name] == pointer for name, pointer in live.items())  # filled in place
    stored, _ = load_checkpoint(catalog_for(saved), 2)
    for piece in engine.state_slices():
        assert torch.equal(piece.tensor, stored[piece.name]), piece.name
