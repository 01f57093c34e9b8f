"""Controller-side chaos with the fake worker group: storage faults on the catalog, corrupt_shard,
a rank's failed shard write; each run must go on and leave only checkpoints that verify."""

from __future__ import annotations

import pytest

from ckpt.catalog import Catalog
from ckpt.manifest import step_dir
from ckpt.reader import verify_checkpoint
from ckpt.storage import Storage
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)


def _run(tmp_path, rendezvous, faults, steps=30, checkpoint_over=None, **fake):
    checkpoint = {"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2, **(checkpoint_over or {})}
    spec = _spec(tmp_path, chaos={"faults": faults}, train={"steps": steps, "global_batch": 4, "micro_batch": 1},
                 checkpoint=checkpoint)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    for name, value in fake.items():
        setattr(workers, name, value)
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    report = ctl.run()
    return ctl, report, "\n".join(lines)


def _skipped(ctl) -> float:
    return ctl.metrics.registry.get_sample_value("undying_checkpoint_skipped_total", {"undying_job": "unit"})


def _failed(ctl) -> float:
    return ctl.metrics.registry.get_sample_value("undying_checkpoint_failures_total", {"undying_job": "unit"})


def _verified(ctl) -> list[int]:
    catalog = Catalog(Storage(ctl.spec.checkpoint_root))  # without the controller's faults
    steps = catalog.committed_steps()
    for step in steps:
        verify_checkpoint(catalog, step)
    return steps


def test_a_failed_shard_write_drops_that_save_and_the_next_one_commits(tmp_path, rendezvous):
    # Rank 0's error arrives first: rank 1's later receipt of step 20 must not reopen the save
    # (it would sit pending, in CHECKPOINTING, until step 30 overtook it).
    ctl, report, text = _run(tmp_path, rendezvous, [], fail_shard={20: 0})
    assert report.status == "succeeded", report.error
    assert "checkpoint step 20 will not be committed: rank 0 failed to write its shard" in text
    assert "step 20: shards arriving" not in text
    assert [c.step for c in report.checkpoints] == [10, 30] and report.failures == []
    assert (_failed(ctl), _skipped(ctl)) == (1, 0)
    assert _verified(ctl) == [10, 30]


def test_a_save_that_never_commits_still_books_its_blocking_time(tmp_path, rendezvous):
    blocking = 0.2  # each of the saves of steps 10, 20 (rank 0's write fails) and 30
    _, report, _ = _run(tmp_path, rendezvous, [], fail_shard={20: 0}, blocking_s=blocking)
    assert [c.step for c in report.checkpoints] == [10, 30]
    assert report.goodput.badput_s["checkpoint_save"] >= 3 * blocking - 0.01, report.goodput


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_failed_manifest_commit_is_retried_once(tmp_path, rendezvous, when):
    # "after": the manifest landed and the reply was lost; the retry finds our own manifest.
    ctl, report, text = _run(tmp_path, rendezvous, [
        {"kind": "storage_error", "path": "*/manifest.json", "at_step": 20, "when": when}])
    assert report.status == "succeeded", report.error
    assert f"chaos: storage_error ({when}) on the controller's write of" in text
    assert [c.step for c in report.checkpoints] == [10, 20, 30] and report.failures == []
    assert (_failed(ctl), _skipped(ctl)) == (0, 0)
    assert _verified(ctl) == [20, 30]


def test_a_write_fault_on_the_controller_fails_a_checkpoint_write_not_its_telemetry(tmp_path, rendezvous):
    # The controller's second write: the goodput snapshot after the first commit, when it went through
    # the catalog's storage (the fault aimed at the checkpoints was spent on it); now step 20's manifest.
    ctl, report, text = _run(tmp_path, rendezvous, [{"kind": "storage_error", "op": "write", "nth": 2}])
    assert report.status == "succeeded", report.error
    assert "chaos: storage_error (before) on the controller's write of" in text
    fired = text.split("chaos: storage_error (before) on the controller's write of")[1].splitlines()[0]
    assert fired.endswith(f"{step_dir(20)}/manifest.json"), fired
    assert [c.step for c in report.checkpoints] == [10, 20, 30]  # its retry committed it
    assert ctl.snapshots.load()["ended"] is True  # the snapshot itself was written, to the end


def test_a_manifest_commit_failing_twice_skips_the_save_and_the_job_goes_on(tmp_path, rendezvous):
    ctl, report, text = _run(tmp_path, rendezvous, [
        {"kind": "storage_error", "op": "write", "path": "*/manifest.json", "at_step": 20, "repeat": True}])
    assert report.status == "succeeded", report.error
    assert "checkpoint step 20 will not be committed: the manifest commit failed twice" in text
    assert [c.step for c in report.checkpoints] == [10, 30] and report.failures == []
    assert (_failed(ctl), _skipped(ctl)) == (1, 0)
    assert _verified(ctl) == [10, 30]


def test_a_torn_manifest_is_moved_aside_and_the_retry_commits(tmp_path, rendezvous):
    ctl, report, text = _run(tmp_path, rendezvous, [{"kind": "torn_write", "path": "*/manifest.json", "at_step": 20}])
    assert report.status == "succeeded", report.error
    assert "chaos: torn_write (torn) on the controller's write of" in text
    assert [c.step for c in report.checkpoints] == [10, 20, 30]
    assert _verified(ctl) == [20, 30]


def test_a_manifest_torn_twice_never_looks_committed(tmp_path, rendezvous):
    # Step 20 is the final step: nothing commits after it, so what the failed commit left stays.
    ctl, report, text = _run(tmp_path, rendezvous, [
        {"kind": "torn_write", "path": "*/manifest.json", "at_step": 20, "repeat": True}], steps=20)
    assert report.status == "failed" and "final checkpoint (step 20) was not committed" in report.error
    assert "the manifest commit failed twice" in text
    assert _verified(ctl) == [10]  # the torn manifest is not where a reader would take it for committed
    aside = list((tmp_path / "ckpt" / "unit" / step_dir(20)).glob("manifest.torn-*.json"))
    assert len(aside) == 2  # one per attempt
    assert not (tmp_path / "ckpt" / "unit" / step_dir(20) / "manifest.json").exists()


def test_a_job_whose_only_save_tore_reruns_without_fresh(tmp_path, rendezvous):
    # Torn manifests were never committed: they are withdrawn, not quarantined as corrupt checkpoints,
    # so the rerun has no progress to lose and starts from step 0 as a first run does.
    ctl, report, text = _run(tmp_path, rendezvous, [
        {"kind": "torn_write", "path": "*/manifest.json", "at_step": 10, "repeat": True}], steps=10)
    assert report.status == "failed" and "final checkpoint (step 10) was not committed" in report.error
    assert len(list((tmp_path / "ckpt" / "unit" / step_dir(10)).glob("manifest.torn-*.json"))) == 2
    assert ctl.catalog.quarantined_steps() == []
    ctl, report, text = _run(tmp_path, rendezvous, [], steps=10)
    assert report.status == "succeeded", report.error
    assert "fresh start (no committed checkpoint)" in text and _verified(ctl) == [10]


def test_an_unreadable_manifest_found_at_restore_is_reported_and_skipped(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, []).run()
    manifest = tmp_path / "ckpt" / "unit" / step_dir(30) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # torn by an earlier controller that then died
    ctl, report, text = _run(tmp_path, rendezvous, [])
    assert report.status == "succeeded", report.error
    assert "checkpoint step 30 is corrupt" in text and "the manifest is not JSON" in text and "moved aside" in text
    assert "restored step 20" in text
    assert [c.step for c in report.checkpoints] == [30]  # saved and committed again
    assert _verified(ctl) == [20, 30]


def test_corrupt_shard_forces_a_loud_fallback_at_the_next_restore(tmp_path, rendezvous):
    ctl, report, text = _run(tmp_path, rendezvous, [{"kind": "corrupt_shard", "at_step": 20}],
                             die_at={25: 1}, verify_restore=True, step_sleep=0.015)
    assert report.status == "succeeded", report.error
    assert "chaos: corrupt_shard on committed step 20: bit" in text
    assert "checkpoint step 20 is corrupt" in text and "moved aside" in text and "restored step 10" in text
    # The rank's death is blamed on nothing else (a corruption makes no rank fail).
    assert [(f.kind, f.rank) for f in report.failures] == [("rank_died", 1)]
    assert [c.step for c in report.checkpoints] == [10, 20, 20, 30]  # 20 saved and committed again
    assert _verified(ctl) == [20, 30]
    # The recovery booked steps 20-24 as lost before the restore; landing at 10, steps 10-19 (0.01 s
    # each, the fake's step time) are redone too, and booked so.
    assert "restored step 10; older than step 20 the recovery expected: 0.10 s more work to redo" in text
    died = report.failures[0]
    assert died.lost_work_s > 0.10 + 5 * 0.01 - 1e-9
    assert report.goodput.badput_s["lost_work"] == pytest.approx(died.lost_work_s)


def test_a_listing_error_at_restore_is_retried(tmp_path, rendezvous):
    # An I/O error proves nothing and is transient: the controller's listing is tried again.
    ctl, report, text = _run(tmp_path, rendezvous, [{"kind": "storage_error", "op": "list", "nth": 1}])
    assert report.status == "succeeded", report.error
    assert report.failures == [] and "chaos: storage_error (before) on the controller's list" in text
    assert _verified(ctl) == [20, 30]


def test_a_timed_fault_due_with_no_rank_to_fire_at_is_recorded_in_the_report(tmp_path, rendezvous):
    # After a shrink, a kill drawn for a rank the job no longer runs fires nowhere: the report says so,
    # or an experiment would count on failures that never happened.
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_rank", "rank": 1, "at_seconds": 0.0}]})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    ctl.fault_clock.schedule(spec.world_size)
    workers.actors.pop(1, None)  # the job runs without rank 1 now
    ctl.fault_clock.fire_due(world_size=1)
    [skipped] = ctl.record.report("failed", 0).faults_skipped
    assert (skipped.kind, skipped.fault_id, skipped.rank) == ("kill_rank", 0, 1)
    assert "the job runs 1 rank(s) now" in skipped.detail and any("skipped" in line for line in lines)


def test_a_timed_fault_whose_rank_failed_the_call_is_recorded_not_believed(tmp_path, rendezvous):
    # The rank's actor was gone (or in no generation): its inject call failed and no notice came. A kill
    # that fired fails its call too (the actor died of it), but its notice says it fired: not skipped.
    from orchestrator.controller import fault_clock
    from orchestrator.wire.messages import FaultFired

    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_rank", "rank": 0, "at_seconds": 0.0},
                                             {"kind": "kill_rank", "rank": 1, "at_seconds": 0.0}]})
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    workers.inject = lambda rank, fault: f"call-{rank}"  # every call fails, as on a dead actor
    workers.injection_error = lambda ref: "RayActorError: the actor died"
    ctl = _controller(spec, workers, rendezvous, [])
    now = [0.0]
    ctl.fault_clock.clock = lambda: now[0]
    workers.ensure_actors([0, 1])
    ctl.fault_clock.schedule(spec.world_size)
    ctl.fault_clock.fire_due(world_size=2)
    ctl.fault_clock.on_fired(FaultFired(fault_id=0, kind="kill_rank", rank=0, step=3, point="timed", time=0.0))
    now[0] = fault_clock.NOTICE_GRACE_S - 1
    ctl.fault_clock.fire_due(world_size=2)
    assert ctl.record.report("failed", 0).faults_skipped == []  # its notice may still be on its way
    now[0] = fault_clock.NOTICE_GRACE_S + 1
    ctl.fault_clock.fire_due(world_size=2)
    [skipped] = ctl.record.report("failed", 0).faults_skipped
    assert (skipped.fault_id, skipped.rank) == (1, 1) and "its actor failed the call (RayActorError" in skipped.detail


def test_random_node_kills_follow_a_lost_nodes_place_to_the_node_that_replaced_it():
    # The failures are drawn per node place (its lowest rank): once the node at a place is lost and
    # another takes its ranks, that place's later failures hit the new node, not no one.
    from types import SimpleNamespace

    from chaos.config import ChaosConfig
    from orchestrator.controller.fault_clock import FaultClock

    nodes = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
    fired = []
    workers = SimpleNamespace(actors=dict.fromkeys(nodes), controller_node=lambda: "head", node_of=nodes.get,
                              inject=lambda rank, fault: fired.append((rank, nodes[rank])))
    chaos = ChaosConfig(mtbf_s="10s", mtbf_kind="kill_node", mtbf_max_faults=8, seed=1)
    now = [0.0]
    clock = FaultClock(SimpleNamespace(chaos=chaos), workers, lambda: now[0], lambda line: None)
    clock.schedule(4)
    nodes.update({0: "n7", 1: "n7"})  # n1 was lost; n7 took its ranks
    now[0] = 10**6
    clock.fire_due(world_size=4)
    assert clock.skipped == [] and len(fired) == 8
    assert {node for _, node in fired} == {"n7", "n2"}
    # Lost with no new node in its place (its ranks went to n2, a node drawn for itself): its failures
    # are skipped, said so, rather than doubling n2's rate.
    fired.clear()
    clock = FaultClock(SimpleNamespace(chaos=chaos), workers, lambda: now[0], lambda line: None)
    nodes.update({0: "n1", 1: "n1"})
    now[0] = 0.0
    clock.schedule(4)
    nodes.update({0: "n2", 1: "n2"})
    now[0] = 10**6
    clock.fire_due(world_size=4)
    assert {node for _, node in fired} == {"n2"} and len(fired) + len(clock.skipped) == 8
    assert clock.skipped and all("nor on a new node in its place" in s.detail for s in clock.skipped)
