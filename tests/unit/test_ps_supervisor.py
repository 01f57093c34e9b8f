"""The parameter-server supervisor's loop (paramserver.supervisor) against an in-process fake of Ray
(tests/_ps_fake.py).

The fake keeps the protocol's real arithmetic (ShardServer and PSWorker of a tiny model) and Ray's
shape as the supervisor sees it: actor handles whose `.remote` calls answer at once, workers' runs
as streams of step logs, `ray.kill`, and a clock that moves one poll per `ray.wait` with a timeout
(each live worker does at most one step per poll, in bsp the others wait for the slowest). So the
supervisor's decisions run exactly, fast: which actor it replaces, where a worker resumes, what it
restores, what the ledger books. The real actors and Ray are tested in tests/ray/test_ps_faults.py.
"""

from __future__ import annotations

import types
from collections import Counter

import pytest
from ray.exceptions import GetTimeoutError

from ckpt.failed_saves import SavesFailing
from paramserver import supervisor as sup
from paramserver.recovery import Fault
from paramserver.restart_budget import RestartsSpent
from tests._ps_fake import PAR, TRAIN, Died, FakeServer, FakeWorker, Method, World, fake_ray, reference_losses
from tests._ps_fake import applied_once as _applied_once
from tests._ps_fake import run_supervisor as _run


@pytest.fixture
def world(monkeypatch):
    return fake_ray(monkeypatch)


@pytest.fixture(scope="module")
def expected():
    return reference_losses()


def test_without_faults_every_segment_is_saved_and_the_wall_is_productive(world, expected):
    commits = []
    supervisor, losses, ledger = _run(world, on_commit=lambda commit: commits.append(commit.step))
    assert losses == expected and supervisor.saved == [4, 8] == commits and supervisor.failures == []
    totals = ledger.totals()
    assert totals["productive"] > 0 and totals["reformation"] == totals["lost_work"] == 0
    assert sum(totals.values()) == pytest.approx(ledger.wall())
    # Each save carries the ledger as it was (a resumed job carries it on: orchestrator.cli.ps_run).
    assert 0 < world.states[4]["goodput"]["productive"] < world.states[8]["goodput"]["productive"]


def test_a_dead_worker_is_replaced_where_the_servers_have_it_and_nobody_else_restarts(world, expected):
    supervisor, losses, ledger = _run(world, [Fault("worker", 1, 5)])
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("worker", 1, "replaced", 5)
    assert losses == expected and _applied_once(supervisor) and supervisor.redone == 0
    # Two servers and two workers, then one replacement: worker 0 and the servers never restarted.
    assert len(world.workers) == 3 and [s.pid for s in supervisor.servers] == [101, 102]
    first = {log.pid for log in supervisor.logs.values() if log.worker == 0}
    assert first == {world.workers[0].proc}
    assert failure.pids == {"old": world.workers[1].proc, "new": world.workers[2].proc}
    totals = ledger.totals()
    assert failure.pause_s > 0 and totals["reformation"] == pytest.approx(failure.pause_s)
    assert failure.detected_at > failure.injected_at
    assert totals["detection"] == pytest.approx(failure.detected_at - failure.injected_at)
    assert sum(totals.values()) == pytest.approx(ledger.wall())


def test_a_worker_whose_replacements_keep_dying_fails_the_job_instead_of_replacing_it_forever(world, monkeypatch):
    started, start_worker = Counter(), world.start_worker

    def start(w):  # worker 1's replacements die as they start (a constructor that runs out of memory)
        worker, started[w] = start_worker(w), started[w] + 1
        if w == 1 and started[w] > 1:
            run = worker._run
            worker.run = types.SimpleNamespace(remote=lambda *a, **k: _ended(run(*a, **k)))
        return worker

    def _ended(stream):
        stream.end(Died("the actor died in __init__: out of memory"))
        return stream

    monkeypatch.setattr(world, "start_worker", start)
    loop = r"rolled back 3 times in a row for the same reason \(elastic.crash_loop_limit=3\)"
    with pytest.raises(RestartsSpent, match=loop) as failed:
        _run(world, [Fault("worker", 1, 5)])
    assert "worker 1 was replaced 3 times and died before a step" in str(failed.value)
    # Then one per rollback: the first threw away more steps than the three in a row after it (worker 0
    # had run step 5 beside the original worker 1's step 4), so it failed at another step: no loop yet.
    assert "out of memory" in str(failed.value) and started[1] == 1 + 3 + 4


def test_a_dead_server_rolls_every_server_back_to_the_last_commit(world, expected):
    supervisor, losses, ledger = _run(world, [Fault("server", 0, 6)])
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.resumed_at, failure.steps_redone) == ("server", 0, 4, 2)
    assert losses == expected and _applied_once(supervisor) and supervisor.redone == 2 * PAR.dp
    assert supervisor.servers[0].pid not in (101, 102) and supervisor.servers[1].pid == 102
    assert world.workers[:2] == supervisor.workers  # the same worker actors
    totals = ledger.totals()
    assert totals["lost_work"] > 0 and totals["checkpoint_restore"] >= 0 and totals["detection"] >= 0
    assert sum(totals.values()) == pytest.approx(ledger.wall())


def test_a_corrupt_newest_commit_is_quarantined_and_the_rollback_restores_the_one_before(world, expected, monkeypatch):
    from ckpt.errors import CorruptCheckpoint

    restore, quarantined = world.restore, []

    def restoring(servers, root, step, **kwargs):  # step 4's bytes prove corrupt; the read budget is the job's
        assert kwargs["read_retry_s"] == 7.0
        if step == 4 and not quarantined:
            raise CorruptCheckpoint("step 4: shard-00000 block 0 fails its CRC-32C on a re-read")
        return restore(servers, root, step, **kwargs)

    def fake_catalog(root, storage_options=None, owner=None):  # what the fallback asks of the store
        committed = lambda: [s for s in sorted(world.commits) if s not in quarantined]  # noqa: E731
        return types.SimpleNamespace(quarantine=quarantined.append, committed_steps=committed)

    monkeypatch.setattr(sup.checkpoint, "restore_servers", restoring)
    monkeypatch.setattr(sup.checkpoint, "catalog", fake_catalog)
    monkeypatch.setattr(sup.checkpoint, "_proven_here", lambda *args: True)  # the driver's own read: bad too
    actors = sup.Actors(lambda k: FakeServer(world, k), world.start_worker)
    checkpoints = sup.Checkpoints("fake://ckpt", 2, job=None, read_retry_s=7.0)
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints,
                                faults=[Fault("server", 0, 5)])
    supervisor.run()
    [failure] = supervisor.failures
    assert quarantined == [4] and (failure.resumed_at, failure.from_checkpoint) == (2, True)
    assert supervisor.logs.losses() == expected and supervisor.saved == [2, 4, 6, 8]


def test_a_commit_only_a_server_could_not_read_is_neither_restored_nor_taken_for_this_run_s_save(world, expected,
                                                                                                 monkeypatch):
    from ckpt.errors import CorruptCheckpoint

    restore, tried = world.restore, []

    def restoring(servers, root, step, **kwargs):  # a server's stale view of step 4; the driver reads it intact
        tried.append(step)
        if step == 4:
            raise CorruptCheckpoint("step 4 has no committed manifest")
        return restore(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "restore_servers", restoring)
    monkeypatch.setattr(sup.checkpoint, "_proven_here", lambda *args: False)
    monkeypatch.setattr(sup.checkpoint, "catalog", lambda *args: types.SimpleNamespace(
        committed_steps=lambda: sorted(world.commits)))
    supervisor, losses, _ = _run(world, [Fault("server", 0, 5)], every=2)
    assert tried == [4, 2] and supervisor.skipped == {4}
    assert losses == expected and supervisor.saved == [2, 6, 8]  # 4 not counted as saved: an earlier run's


def test_without_a_commit_a_dead_server_restarts_every_server_from_the_initial_values(world, expected):
    supervisor, losses, _ = _run(world, [Fault("server", 1, 3)], every=None)
    [failure] = supervisor.failures
    assert (failure.resumed_at, failure.from_checkpoint, failure.steps_redone) == (0, False, 3)
    assert losses == expected and _applied_once(supervisor)
    assert "the initial values (step 0)" in failure.line()


def test_a_torn_push_rolls_back_instead_of_replaying(world, expected, monkeypatch):
    # Worker 1 dies after pushing step 2 to server 0 only: server 0 may already apply it, so no
    # replacement can push it to server 1 alone, computed on the same version.
    original = FakeWorker.advance

    def tearing(self, now):
        if self.worker.index == 1 and self.next == 2 and not self.dead and len(world.workers) == 2:
            second = self.servers[1]
            self.servers[1] = types.SimpleNamespace(shard=types.SimpleNamespace(
                may_read=second.shard.may_read, pull=second.shard.pull, push=lambda push: None),
                dead=False, stopped=False, sigstopped=False, holds=set(), cut_at=None, frozen=False, answered=-1)
            original(self, now)
            self.servers[1] = second
            return self.kill()
        return original(self, now)

    monkeypatch.setattr(FakeWorker, "advance", tearing)
    supervisor, losses, _ = _run(world)
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("torn_push", 1, "restored", 0)
    assert losses == expected and _applied_once(supervisor)


def _preempted(world: World, grace_s: float, signals=(15,)):
    from paramserver.preemption import Preempted, Preemption

    actors = sup.Actors(lambda k: FakeServer(world, k), world.start_worker)
    preemption = Preemption(grace_s, clock=lambda: world.now)
    for signum in signals:  # arrived before the first step
        preemption.on_signal(signum)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, preemption=preemption)
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints)
    with pytest.raises(Preempted) as stop:
        supervisor.run()
    return supervisor, str(stop.value)


def test_a_signal_cuts_the_segment_where_every_worker_can_stop_and_the_job_stops_at_that_commit(world):
    from paramserver.preemption import Preempted, Preemption

    preemption = Preemption(1e6, clock=lambda: world.now)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, preemption=preemption)  # no drain watcher
    supervisor = sup.Supervisor(sup.Actors(lambda k: FakeServer(world, k), world.start_worker), PAR.servers, PAR.dp,
                                TRAIN.steps, checkpoints=checkpoints)
    tick, signalled = world.tick, {}

    def tick_then_signal_after_the_first_step():
        tick()
        if supervisor.logs and not signalled:
            signalled["at"] = max(step for _, step in supervisor.logs)
            preemption.on_signal(15)

    world.tick = tick_then_signal_after_the_first_step
    with pytest.raises(Preempted) as stop:
        supervisor.run()
    [cut] = supervisor.saved
    assert signalled["at"] < cut < 4, (signalled, supervisor.saved)  # a step or so on, not the segment's end
    assert f"SIGTERM: stopped at checkpoint step {cut}, just committed" in str(stop.value)
    assert max(step for _, step in supervisor.logs) == cut - 1  # nothing trained past the commit
    assert supervisor.redone == 0 and supervisor.moved == []


def test_a_segment_that_cannot_end_in_time_stops_where_it_is(world):
    supervisor, why = _preempted(world, grace_s=0.0)
    assert supervisor.saved == [] and "SIGTERM: the segment under way stopped before any checkpoint" in why
    assert max((step for _, step in supervisor.logs), default=-1) < 3  # stopped before the segment's end


def test_a_second_signal_stops_at_once_and_a_save_that_would_not_fit_cuts_the_segment(world):
    from paramserver.preemption import Preempted, Preemption

    clock = [0.0]
    preemption = Preemption(25.0, clock=lambda: clock[0])
    preemption.on_signal(15)
    assert not preemption.cut_now() and preemption.left_s() == 25.0
    preemption.on_commit(types.SimpleNamespace(total_s=8.0))  # a save takes 8 s: 16 s must be left
    clock[0] = 9.5
    assert preemption.cut_now() and preemption.left_s() == 15.5
    preemption.on_signal(15)  # a pod's second stopper: the same request, within the first one's grace
    with pytest.raises(Preempted, match="SIGINT during the grace: stopped at once"):
        preemption.on_signal(2)  # raised by the handler, wherever the driver is


def test_a_signal_during_the_last_segment_lets_the_job_finish(world):
    from paramserver.preemption import Preemption

    actors = sup.Actors(lambda k: FakeServer(world, k), world.start_worker)
    preemption = Preemption(1e6, clock=lambda: world.now)
    checkpoints = sup.Checkpoints("fake://ckpt", 8, job=None, preemption=preemption)  # one segment: the last
    preemption.on_signal(15)
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints)
    supervisor.run()  # no Preempted: the job is done, its final checkpoint committed
    assert supervisor.saved == [8]


def test_a_server_lost_after_a_signal_ends_the_job_at_its_last_commit_without_a_restore(world):
    from paramserver.preemption import Preempted, Preemption

    preemption = Preemption(1e6, clock=lambda: world.now)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, preemption=preemption)
    supervisor = sup.Supervisor(sup.Actors(lambda k: FakeServer(world, k), world.start_worker), PAR.servers, PAR.dp,
                                TRAIN.steps, checkpoints=checkpoints, faults=[Fault("server", 0, 6)])
    tick = world.tick

    def signal_in_the_last_segment():  # where the job runs on to its end; then server 0 dies at step 6
        tick()
        if supervisor.saved and not preemption.signals:
            preemption.on_signal(15)

    world.tick = signal_in_the_last_segment
    with pytest.raises(Preempted, match="SIGTERM"):
        supervisor.run()
    assert supervisor.saved == [4] and supervisor.failures == []  # no rollback: the restore would outlast the grace


# ---- a drained node ----

def _drained_at(world: World, seconds: float):
    """Ray's drain table: the node "doomed" drains from `seconds` into the job on (after the poll the
    start's wait for the actors' first answers takes)."""
    started = world.now + sup.POLL_S
    return lambda: ["doomed"] if world.now - started >= seconds else []


def test_a_drained_node_s_server_and_worker_move_off_at_a_saved_cut_with_nothing_redone(world, expected):
    world.nodes = {("server", 1): "doomed", ("worker", 0): "doomed"}
    supervisor, losses, ledger = _run(world, draining=_drained_at(world, 5.5 * sup.POLL_S))
    assert losses == expected  # bsp: bit for bit the failure-free run
    assert supervisor.failures == [] and supervisor.redone == 0
    cut = next(step for step in supervisor.saved if step % 4)
    assert 4 < cut < 8 and supervisor.saved == [4, cut, 8], supervisor.saved
    assert supervisor.moved == ["worker 0 moved off draining node(s) doomed",
                                "server 1 moved off draining node(s) doomed, restored from the cut"]
    assert "server 1 #2" in supervisor.pids and "worker 0 #2" in supervisor.pids
    assert [s.where for s in supervisor.servers] == ["safe", "elsewhere"]
    assert _applied_once(supervisor)  # the moved server's records came with it, nothing applied twice
    assert ledger.totals().get("lost_work", 0.0) == 0.0


def test_a_server_whose_cut_was_not_committed_stays_and_its_worker_still_moves(world, expected, monkeypatch):
    world.nodes = {("server", 1): "doomed", ("worker", 0): "doomed"}
    save = world.save

    def refusing_the_cut(servers, root, step, **kwargs):
        if step % 4:
            raise sup.checkpoint.PSCheckpointError(f"step {step}: the store said no")
        return save(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", refusing_the_cut)
    supervisor, losses, _ = _run(world, draining=_drained_at(world, 5.5 * sup.POLL_S))
    assert losses == expected and supervisor.redone == 0
    assert supervisor.moved[0] == "worker 0 moved off draining node(s) doomed"
    assert supervisor.moved[1].startswith("server 1 stays on draining node(s) doomed: the cut was not committed")
    assert [s.where for s in supervisor.servers] == ["safe", "doomed"]


def test_a_server_that_dies_in_a_save_that_fails_is_rolled_back_not_fatal_to_the_metrics(world, expected,
                                                                                        monkeypatch):
    # The save of step 4 fails on its store, and server 0 dies meanwhile: the job goes on, the next
    # segment's polls find the server; the metrics get each drain's stats before a save.
    killed = []

    save = world.save

    def failing_and_killing(servers, root, step, **kwargs):
        if not killed:
            killed.append(servers[0].pid)
            servers[0].kill()
            raise sup.checkpoint.PSCheckpointError(f"step {step}: the store said no")
        return save(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", failing_and_killing)
    seen = []
    on_stats = lambda stats: seen.append([s.version for s in stats])  # noqa: E731
    supervisor, losses, ledger = _run(world, on_stats=on_stats)
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.resumed_at, failure.from_checkpoint) == ("server", 0, 0, False)
    assert losses == expected and _applied_once(supervisor) and supervisor.saved == [4, 8]
    assert seen and seen[-1] == [TRAIN.steps] * PAR.servers  # the last save's stats, from the live servers
    # The rollback went back to step 0, past the segment [0, 4) whose save failed: its work is lost too.
    totals = ledger.totals()
    assert totals["lost_work"] >= 4 * sup.POLL_S - 1e-9, totals
    assert sum(totals.values()) == pytest.approx(ledger.wall())


@pytest.mark.parametrize("failing, every, words", [
    ({8}, 4, "the final checkpoint (step 8) was not committed (step 8: the store said no)"),
    ({1, 2, 4, 5, 6}, 1, "3 consecutive saves failed (steps 4, 5, 6; checkpoint.max_failed_saves=3)"),
])
def test_the_final_save_or_a_run_of_failed_saves_fails_the_job(world, monkeypatch, failing, every, words):
    save, tried = world.save, []

    def refusing(servers, root, step, **kwargs):
        tried.append(step)
        if step in failing:
            raise sup.checkpoint.PSCheckpointError(f"step {step}: the store said no")
        return save(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", refusing)
    with pytest.raises(SavesFailing) as failed:
        _run(world, every=every)
    assert words in str(failed.value) and tried[-1] == max(failing)  # two failures, then a commit: goes on


def test_a_save_off_the_cut_rolls_the_segment_back_instead_of_passing_for_a_storage_failure(world, expected,
                                                                                           monkeypatch):
    from paramserver.shard import NotAtCut

    save, refused = world.save, []

    def off_the_cut(servers, root, step, **kwargs):  # as a server whose drain cut was never lifted answers
        if not refused:
            refused.append(step)
            raise NotAtCut(f"server 0 is not at step {step}: its workers have pushed [3, 3] steps")
        return save(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", off_the_cut)
    supervisor, losses, _ = _run(world)
    [failure] = supervisor.failures
    assert refused == [4] and "NotAtCut: server 0 is not at step 4" in failure.line()
    assert losses == expected and supervisor.saved == [4, 8] and _applied_once(supervisor)


def test_a_moved_server_that_finds_no_seat_stays_and_the_job_goes_on(world, expected):
    world.nodes = {("server", 1): "doomed", ("worker", 0): "doomed"}
    started = Counter()

    def start_server(k: int) -> FakeServer:
        started[k] += 1
        server = FakeServer(world, k)
        if started[k] == 2:  # the replacement: Ray finds it no seat off the draining node in time

            def pending():
                raise GetTimeoutError("the actor is pending placement")

            server.progress = Method(server, pending)
        return server

    supervisor, losses, _ = _run(world, draining=_drained_at(world, 5.5 * sup.POLL_S), start_server=start_server)
    assert losses == expected and supervisor.redone == 0 and supervisor.failures == []
    assert supervisor.moved[0] == "worker 0 moved off draining node(s) doomed"
    assert supervisor.moved[1].startswith("server 1 stays on draining node(s) doomed: its replacement did not "
                                          "start or restore (GetTimeoutError")
    assert [s.where for s in supervisor.servers] == ["safe", "doomed"]


def test_a_kill_armed_at_the_cut_fires_in_the_next_segment_and_the_cut_still_moves(world, expected):
    world.nodes = {("server", 1): "doomed", ("worker", 0): "doomed"}
    supervisor, losses, _ = _run(world, faults=[Fault("worker", 1, 6)], draining=_drained_at(world, 5.5 * sup.POLL_S))
    cut = next(step for step in supervisor.saved if step % 4)
    assert cut == 6, supervisor.saved  # the drain's cut fell on the kill's step: held holds past it were dropped
    [failure] = supervisor.failures  # fired once, after the cut, where its pull was held again
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("worker", 1, "replaced", 6)
    assert losses == expected and supervisor.redone == 0 and _applied_once(supervisor)
    assert supervisor.moved[-1] == "server 1 moved off draining node(s) doomed, restored from the cut"


def test_a_signal_while_a_drain_s_cut_is_pending_saves_the_cut_and_moves_nothing_as_the_job_stops_there(world):
    from paramserver.preemption import Preempted, Preemption

    world.nodes = {("server", 1): "doomed"}
    preemption = Preemption(1e6, clock=lambda: world.now)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, preemption=preemption,
                                  draining=lambda: ["doomed"] if supervisor.logs else [])  # once a step is done
    supervisor = sup.Supervisor(sup.Actors(lambda k: FakeServer(world, k), world.start_worker), PAR.servers, PAR.dp,
                                TRAIN.steps, checkpoints=checkpoints)
    tick = world.tick

    def tick_then_signal_once_the_drain_cut():
        tick()
        if supervisor.cut is not None and not preemption.signals:
            preemption.on_signal(15)

    world.tick = tick_then_signal_once_the_drain_cut
    with pytest.raises(Preempted) as stop:
        supervisor.run()
    [cut] = supervisor.saved
    assert preemption.signals and 0 < cut < 4
    assert f"stopped at checkpoint step {cut}, just committed" in str(stop.value)
    assert supervisor.moved == []  # the job ends at the cut: a move would only spend the grace


def test_a_server_lost_once_the_final_step_is_committed_rolls_nothing_back(world, monkeypatch):
    def save_then_lose_server_0(servers, root, step, **kw):
        commit = world.save(servers, root, step, **kw)
        servers[0].dead = step == TRAIN.steps  # lost right after the final commit
        return commit
    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", save_then_lose_server_0)
    supervisor, _, _ = _run(world)
    assert supervisor.saved == [4, 8] and supervisor.failures == []  # the job is done, nothing restored


def test_the_driver_hands_its_signals_over_once_the_actors_are_up_and_resumed(world):
    # `undying run` routes signals to the preemption only then (ps_run: before, a signal stops it at once).
    _run(world)
    del world.commits[8]  # the job's last commit is step 4: this run resumes there
    seen = []
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, on_training=lambda: seen.append(
        (len(supervisor.logs), [s.shard.version for s in supervisor.servers])))
    supervisor = sup.Supervisor(sup.Actors(lambda k: FakeServer(world, k), world.start_worker), PAR.servers, PAR.dp,
                                TRAIN.steps, checkpoints=checkpoints)
    supervisor.run()
    assert seen == [(0, [shard.version for shard in world.commits[4]])]  # once: restored, before any step
    assert supervisor.start_step == 4 and supervisor.saved == [8]


def test_each_worker_step_reaches_on_step_as_the_driver_takes_it(world):
    seen = []
    supervisor = sup.Supervisor(sup.Actors(lambda k: FakeServer(world, k), world.start_worker), PAR.servers, PAR.dp,
                                TRAIN.steps, faults=[Fault("server", 1, 3)], on_step=seen.append)
    supervisor.run()  # a rollback to step 0 at step 3: the redone steps come again (both executions ran)
    assert {(log.worker, log.step) for log in seen} == set(supervisor.logs)
    assert len(seen) == PAR.dp * TRAIN.steps + supervisor.redone


def test_a_kill_a_rollback_dealt_with_is_not_blamed_for_a_later_failure(world, expected):
    """A worker's kill and a server's death in one step: the rollback replaces both. The kill's time is
    then spent, not left for the next natural death of that worker to be dated (and exempted) by."""
    supervisor, losses, ledger = _run(world, [Fault("worker", 1, 6), Fault("server", 0, 6)])
    assert losses == expected and _applied_once(supervisor)
    assert supervisor._kills == {}
    assert sum(ledger.totals().values()) == pytest.approx(ledger.wall())


def test_a_server_that_dies_while_the_rollback_restores_is_replaced_and_the_restore_tried_again(
        world, expected, monkeypatch):
    """Its node lost mid-load: one more repair of the budget, not the job's end."""
    real, tries = world.restore, []

    def restore(servers, *args, **kwargs):
        tries.append([s.pid for s in servers])
        if len(tries) == 1:
            servers[1].kill()
            raise Died("the actor died unexpectedly before finishing this task")
        return real(servers, *args, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "restore_servers", restore)
    supervisor, losses, _ = _run(world, [Fault("server", 0, 6)])
    assert losses == expected and _applied_once(supervisor)
    assert len(tries) == 2 and tries[1][0] == tries[0][0] and tries[1][1] != tries[0][1]  # server 1 replaced


def test_two_workers_replaced_together_pause_the_job_once_in_the_ledger(world, expected):
    """A lost node's two workers: their pauses overlap, and the ledger books their union, not their sum
    (which ate productive time of committed segments)."""
    supervisor, losses, ledger = _run(world, [Fault("worker", 0, 5), Fault("worker", 1, 5)])
    assert losses == expected and _applied_once(supervisor)
    pauses = [f.pause_s for f in supervisor.failures if f.kind == "worker"]
    assert len(pauses) == 2 and all(p > 0 for p in pauses)
    assert ledger.totals()["reformation"] == pytest.approx(max(pauses))


def test_overlapping_pauses_book_their_union_in_whatever_order_they_end():
    """Worker A paused 10-20 s, worker B 12-18 s, B's replacement resuming first: 10 s, not 6 + 2."""
    from monitor.goodput import GoodputLedger
    from paramserver.supervisor import Failure

    now = [0.0]
    ledger = GoodputLedger(clock=lambda: now[0])
    ledger.enter("productive")
    now[0] = 100.0
    booking = types.SimpleNamespace(ledger=ledger, _paused=[])
    a, b = Failure("worker", 0, 10.0, "replaced"), Failure("worker", 1, 12.0, "replaced")
    sup.Supervisor._book_pause(booking, b, 18.0)
    sup.Supervisor._book_pause(booking, a, 20.0)
    assert (a.pause_s, b.pause_s) == (10.0, 6.0) and ledger.totals()["reformation"] == pytest.approx(10.0)


def test_each_failure_reaches_the_driver_s_metrics_as_the_supervisor_books_it(world, expected, monkeypatch):
    from monitor.metrics import JobMetrics
    from orchestrator.cli import ps_run

    monkeypatch.setattr(ps_run, "time", types.SimpleNamespace(time=lambda: world.now))  # the supervisor's clock
    metrics, told = JobMetrics("ps"), []
    feeds = ps_run.job_feeds(ps_run.PSMetrics("ps", "bsp", PAR.servers, metrics.registry), metrics, PAR.dp)
    supervisor, losses, _ = _run(world, [Fault("worker", 1, 2), Fault("server", 0, 6)], on_step=feeds["on_step"],
                                 on_failure=lambda failure: (told.append(failure), feeds["on_failure"](failure)))
    assert told == supervisor.failures and [f.kind for f in told] == ["worker", "server"] and losses == expected
    value = metrics.registry.get_sample_value
    assert [value("undying_failures_total", {"undying_job": "ps", "kind": kind})
            for kind in ("worker_died", "server_died")] == [1, 1]
    assert value("undying_generation", {"undying_job": "ps"}) == 2  # each repair a re-formation
    # Detection (both faults injected: their onset known) and recovery of each, as a collective job's.
    assert value("undying_detection_seconds_count", {"undying_job": "ps"}) == 2
    assert value("undying_recovery_seconds_count", {"undying_job": "ps"}) == 2
    assert 0 < value("undying_recovery_seconds_sum", {"undying_job": "ps"}) < 10
