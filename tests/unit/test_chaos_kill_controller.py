"""kill_controller with the fake worker group: the controller dies at a step or around a manifest
commit (a raising stand-in for its SIGKILL), a second controller of the same job resumes from the
last committed checkpoint without dying again, and what the two leave passes the invariant checks."""

from __future__ import annotations

import json

import pytest

import orchestrator.controller.kill as controller_kill
from chaos.config import ArmedFault, as_armed
from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.storage import Storage
from orchestrator.cli.chaos.invariants import check_checkpoints_verify, check_data_once, check_goodput
from orchestrator.controller.kill import ControllerKill, has_fired, marker_name
from orchestrator.wire.store import RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec


class ControllerDied(BaseException):
    """The stand-in for SIGKILL: a BaseException, so no `except Exception` of the controller stops it."""


def _die() -> None:
    raise ControllerDied


@pytest.fixture(autouse=True)
def no_real_kill(monkeypatch):
    monkeypatch.setattr(controller_kill, "_sigkill", _die)


def _run(spec):
    """One `undying run` of `spec`: (report or None if the controller died, its printed lines)."""
    rendezvous = RendezvousServer("127.0.0.1")
    lines: list[str] = []
    ctl = _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, lines)
    try:
        return ctl.run(), lines
    except ControllerDied:
        return None, lines


@pytest.mark.parametrize(("point", "committed_when_killed", "restored"), [
    ("before_manifest_commit", [10], 10),  # every shard of step 20 is durable, its manifest is not
    ("after_manifest_commit", [10, 20], 20),  # step 20 is committed; retention never ran
])
def test_killed_at_a_commit_point_then_the_rerun_resumes_and_never_dies_again(tmp_path, point,
                                                                              committed_when_killed, restored):
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_controller", "at_point": point, "at_step": 15}]},
                 checkpoint={"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 3})
    catalog = Catalog(Storage(spec.checkpoint_root))
    report, lines = _run(spec)
    assert report is None, "the controller should have died"
    assert f"chaos: kill_controller at {point} of step 20: the controller kills itself (SIGKILL)" in lines[-1]
    assert catalog.committed_steps() == committed_when_killed
    fault = ArmedFault.of(spec.chaos.faults[0], 0)
    marker = json.loads(catalog.storage.read(catalog.storage.path("chaos", marker_name(fault))))
    assert (marker["point"], marker["step"], marker["fault_id"]) == (point, 20, 0)

    report, lines = _run(spec)  # the operator runs the same job again
    assert report is not None and report.status == "succeeded", report and report.error
    assert any(f"restored step {restored}" in line for line in lines)
    assert not any("kill_controller" in line for line in lines)  # fired once per job, not per run
    assert catalog.committed_steps() == [10, 20, 30]
    assert check_checkpoints_verify(catalog).ok
    # The history saved with the checkpoint carries the dead controller's steps into the rerun's.
    data = check_data_once(report.history, final_step=30, global_batch=spec.train.global_batch)
    assert data.ok, data.detail
    goodput = check_goodput({"productive": report.goodput.productive_s, **report.goodput.badput_s},
                            wall_s=report.goodput.clock_wall_s)  # the carried wall and this run's clock
    assert goodput.ok, goodput.detail


def test_killed_at_a_step_rolls_back_to_the_last_commit(tmp_path):
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_controller", "at_step": 15}]})
    report, lines = _run(spec)
    assert report is None and "kill_controller after step 15" in lines[-1]
    assert Catalog(Storage(spec.checkpoint_root)).committed_steps() == [10]
    report, lines = _run(spec)
    assert report.status == "succeeded" and any("restored step 10" in line for line in lines)
    assert [p.step for p in report.losses] == list(range(10, 30))
    assert check_data_once(report.history, final_step=30, global_batch=spec.train.global_batch).ok


def test_fire_once_is_per_fault_as_written(tmp_path):
    """The marker is keyed by the fault's index and fields: an edited fault is a new one and arms again."""
    storage = Storage(f"file://{tmp_path}/ckpt/job")
    fault = as_armed({"id": 0, "kind": "kill_controller", "at_step": 5, "at_point": None}, 0)
    kills: list[int] = []
    first = ControllerKill([fault], storage, printer=lambda line: None, kill=lambda: kills.append(1))
    first.on_step(4)
    assert kills == [] and not has_fired(storage, fault)
    first.on_step(6)
    first.on_step(7)
    assert kills == [1] and has_fired(storage, fault) and first.armed == []
    again = ControllerKill([fault], storage, printer=lambda line: None, kill=lambda: kills.append(2))
    assert again.armed == [] and again.spent == [fault]
    edited = fault.model_copy(update={"at_step": 6})
    assert ControllerKill([edited], storage, kill=lambda: None).armed == [edited]


def test_a_kill_that_cannot_be_recorded_is_not_fired(tmp_path):
    class Unwritable:
        def path(self, *parts):
            return "/".join(parts)

        def exists(self, path):
            return False

        def create_exclusive(self, path, data):
            raise OSError("read-only file system")

    lines: list[str] = []
    kill = ControllerKill([{"id": 3, "kind": "kill_controller", "at_step": 0}], Unwritable(), lines.append,
                          kill=lambda: pytest.fail("killed without a record: every rerun would die again"))
    kill.on_step(1)
    assert kill.armed == [] and "NOT fired" in lines[0] and "read-only file system" in lines[0]


def test_the_committer_fires_its_points_around_the_manifest_create(tmp_path):
    calls: list[tuple[str, int, bool]] = []
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    spec = _spec(tmp_path)
    committer = Committer(catalog, "job", "hash", keep=3, fault_point=lambda point, step: calls.append(
        (point, step, step in catalog.committed_steps())))
    rendezvous = RendezvousServer("127.0.0.1")
    workers = FakeWorkerGroup(rendezvous, catalog.storage)
    ctl = _controller(spec, workers, rendezvous, [])
    ctl.checkpoints.committer = committer  # the controller's own committer, observed
    assert ctl.run().status == "succeeded"
    assert calls == [(p, s, p == "after_manifest_commit") for s in (10, 20, 30)
                     for p in ("before_manifest_commit", "after_manifest_commit")]


def test_a_rerun_exports_the_restored_commit_s_time_and_goodput_only_once_carried(tmp_path, monkeypatch):
    from monitor.metrics import JobMetrics

    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_controller", "at_step": 15}]})
    assert _run(spec)[0] is None
    committed_at = Catalog(Storage(spec.checkpoint_root)).read_manifest(10).created_at
    seen, real = [], JobMetrics.on_goodput
    monkeypatch.setattr(JobMetrics, "on_resumed_commit", lambda self, at: seen.append(("commit", at)))

    def on_goodput(self, ledger):
        seen.append(("goodput", ledger.totals().get("productive", 0.0)))
        real(self, ledger)

    monkeypatch.setattr(JobMetrics, "on_goodput", on_goodput)
    report, _ = _run(spec)
    assert report.status == "succeeded"
    assert seen[0] == ("commit", committed_at)  # the restored commit's time, before anything is exported
    assert seen[1][0] == "goodput" and seen[1][1] > 0  # the first export already holds the carried totals


def test_a_fault_that_fired_under_a_killed_controller_is_not_armed_by_the_next_one(tmp_path):
    """kill_rank at step 12, then kill_controller at 15: the rerun resumes at step 10 and passes step 12
    again; the kill_rank fired once per job, as written, so it is not armed in the ranks a second time."""
    from orchestrator.controller.fault_clock import FaultClock
    from orchestrator.controller.faults import ControllerFaults
    from orchestrator.wire.messages import FaultFired

    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_rank", "rank": 1, "at_step": 12},
                                             {"kind": "kill_rank", "rank": 0, "at_step": 14, "repeat": True},
                                             {"kind": "kill_controller", "at_step": 15}]})
    catalog = Catalog(Storage(spec.checkpoint_root))

    def controller():  # what a controller of the job builds at its start
        clock = FaultClock(spec, None, lambda: 0.0, lambda line: None)
        return clock, ControllerFaults(clock.faults, catalog, 0, lambda: 0.0, printer=lambda line: None,
                                       fired=clock.fired)

    clock, faults = controller()
    assert [f.id for f in clock.armed()] == [0, 1, 2]
    for notice in (FaultFired(0, "kill_rank", rank=1, step=12), FaultFired(1, "kill_rank", rank=0, step=14)):
        clock.on_fired(notice)
        faults.remember(notice)  # as the event intake does with each notice
    assert [f.id for f in clock.armed()] == [1, 2]
    clock, _ = controller()  # the controller was killed at step 15; the operator runs the job again
    assert [f.id for f in clock.armed()] == [1, 2]  # the one-shot kill_rank fired under the first controller
    assert clock.fired[0].handled  # never blamed for a failure of this run
