"""The parameter-server supervisor's answers to actors that hang instead of dying, to saves and
restores that stall, and its repair budget (paramserver.hang_watch, paramserver.watchdog,
paramserver.restores, paramserver.restart_budget), against the in-process fake of Ray
(tests/_ps_fake.py: a stopped actor answers no call until it is killed). The real thing, SIGSTOP
included, runs in tests/ray/test_ps_faults.py."""

from __future__ import annotations

import types

import pytest

from paramserver import supervisor as sup
from paramserver.recovery import Failure, Fault
from paramserver.restart_budget import RestartBudget, RestartsSpent
from tests._ps_fake import PAR, TRAIN, FakeServer, FakeWorker, fake_ray, reference_losses
from tests._ps_fake import applied_once as _applied_once
from tests._ps_fake import run_supervisor as _run


@pytest.fixture
def world(monkeypatch):
    return fake_ray(monkeypatch)


@pytest.fixture(scope="module")
def expected():
    return reference_losses()


def test_a_stopped_worker_is_killed_after_the_hang_limit_and_replaced_where_the_servers_have_it(world, expected):
    supervisor, losses, ledger = _run(world, [Fault("worker_hang", 1, 5)])
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("worker", 1, "replaced", 5)
    assert failure.hung.startswith("worker 1 made no step for 10.0") and "elastic.hang_timeout_s 10.0 s" in failure.hung
    assert losses == expected and _applied_once(supervisor) and supervisor.redone == 0
    assert world.workers[1].sigstopped and world.workers[1].dead and not world.workers[0].dead
    # Detection: from its last step (step 4's push) to the kill, the limit and a poll or two.
    assert 10.0 <= ledger.totals()["detection"] <= 10.2


def test_a_stopped_server_is_killed_after_the_hang_limit_and_every_server_restored(world, expected):
    supervisor, losses, ledger = _run(world, [Fault("server_hang", 0, 6)])
    [failure] = supervisor.failures
    assert (failure.kind, failure.target, failure.resumed_at, failure.steps_redone) == ("server", 0, 4, 2)
    assert failure.hung.startswith("server 0 did not answer a progress call for 10.0")
    assert failure.reason == failure.hung and "(hung)" in failure.line()
    assert losses == expected and _applied_once(supervisor)
    assert world.workers[:2] == supervisor.workers  # the workers waited; none is blamed
    assert 10.0 <= ledger.totals()["detection"] <= 10.2


@pytest.mark.parametrize("first_step_s", [None, 30.0])
def test_a_slow_first_step_is_no_hang_until_the_first_step_limit(world, expected, monkeypatch, first_step_s):
    from paramserver.hang_watch import HangLimits

    start_worker = world.start_worker

    def slow_start(w):  # worker 1's first actor takes 60 s to build its model (worker 0 waits in bsp)
        worker = start_worker(w)
        worker.ready_at = world.now + 60.0 if (w, len(world.workers)) == (1, 2) else 0.0
        return worker

    monkeypatch.setattr(world, "start_worker", slow_start)
    hang = HangLimits(first_step_s=first_step_s) if first_step_s else None  # default: 120 s, then 10 s
    supervisor, losses, _ = _run(world, hang=hang)
    assert losses == expected
    if first_step_s is None:
        assert supervisor.failures == []
        return
    [failure] = supervisor.failures  # worker 1's start-up is a hang; worker 0, waiting for it, is not blamed
    assert (failure.target, failure.action, failure.resumed_at) == (1, "replaced", 0)
    assert "elastic.first_step_timeout_s 30.0 s" in failure.hung


@pytest.mark.parametrize("max_restarts", [3, 2])
def test_repairs_past_elastic_max_restarts_in_the_window_fail_the_job(world, expected, max_restarts):
    faults = [Fault("worker", 1, 2), Fault("worker", 0, 3), Fault("server", 1, 6)]
    if max_restarts == 3:
        supervisor, losses, _ = _run(world, faults, budget=RestartBudget(max_restarts=3))
        assert len(supervisor.failures) == 3 and losses == expected
        return
    with pytest.raises(RestartsSpent, match=r"2 repairs used in the last 86400 s \(elastic.max_restarts=2 per "
                                            r"elastic.restart_window_s=86400\); not repaired: a server died"):
        _run(world, faults, budget=RestartBudget(max_restarts=2))


def test_the_restart_window_forgets_old_repairs():
    budget = RestartBudget(max_restarts=1, window_s=60.0)
    budget.repair(0.0, "worker 0 died")
    with pytest.raises(RestartsSpent, match="1 repairs used in the last 60 s"):
        budget.repair(59.0, "worker 1 died")
    budget.repair(61.0, "worker 1 died")  # the first is out of the window
    whole_run = RestartBudget(max_restarts=1, window_s=None)
    whole_run.repair(0.0, "a")
    with pytest.raises(RestartsSpent, match=r"^1 repairs used \(elastic.max_restarts=1\); not repaired: b$"):
        whole_run.repair(1e9, "b")
    def failure(reason: str, injected: float | None = None) -> Failure:
        return Failure("server", 0, 0.0, "restored", injected, resumed_at=4, reason=reason)

    loop = RestartBudget(crash_loop_limit=2)
    loop.rolled_back(4, failure("server 0 did not answer a progress call for 10.3 s"))
    loop.segment_done()  # a finished segment ends the run of rollbacks
    loop.rolled_back(8, failure("server 0 did not answer a progress call for 10.1 s"))
    loop.rolled_back(8, failure("a worker's run failed: OSError"))  # another reason: a run of one again
    loop.rolled_back(8, failure("server 1 died", injected=5.0))  # injected: never a crash loop
    loop.rolled_back(8, failure("server 1 died", injected=6.0))
    with pytest.raises(RestartsSpent, match="crash loop: the segment from step 8 was rolled back 2 times in a row "
                                            r"for the same reason \(elastic.crash_loop_limit=2\)"):
        loop.rolled_back(8, failure("a worker's run failed: OSError"))


@pytest.mark.parametrize("max_restarts", [10, 1])
def test_a_server_that_does_not_finish_its_load_in_time_is_replaced_and_the_restore_tried_again(
        world, expected, monkeypatch, max_restarts):
    from paramserver.checkpoint import ServersTimedOut

    restore, timed_out = world.restore, []

    def restoring(servers, root, step, **kwargs):  # server 1's first load of the rollback hangs
        assert kwargs["timeout"] == (300.0, "elastic.restore_timeout_s")
        if not timed_out:
            timed_out.append(servers[1])
            raise ServersTimedOut(f"the restore of checkpoint step {step}", [1], 300.0, "elastic.restore_timeout_s")
        return restore(servers, root, step, **kwargs)

    monkeypatch.setattr(sup.checkpoint, "restore_servers", restoring)
    actors = sup.Actors(lambda k: FakeServer(world, k), world.start_worker)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, restore_timeout=(300.0, "elastic.restore_timeout_s"))
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints,
                                faults=[Fault("server", 0, 6)], budget=RestartBudget(max_restarts=max_restarts))
    if max_restarts == 1:  # the rollback was the one repair: the second is refused, naming both fields
        with pytest.raises(RestartsSpent, match=r"elastic.max_restarts=1.*servers \[1\] did not finish within 300 s "
                                                r"\(elastic.restore_timeout_s\)"):
            supervisor.run()
        return
    supervisor.run()
    assert supervisor.logs.losses() == expected and _applied_once(supervisor)
    assert timed_out[0].dead and supervisor.servers[1] is not timed_out[0]  # replaced, then restored


def test_a_server_that_stops_between_segments_rolls_back_at_the_save_instead_of_hanging_it(world, expected,
                                                                                          monkeypatch):
    original, stopped = FakeWorker.advance, []

    def stopping(self, now):  # server 0 stops once every worker pushed step 3, the segment's last
        original(self, now)
        if all(w.next == 4 for w in world.workers) and not stopped:
            stopped.append(world.workers[0].servers[0])
            stopped[0].sigstopped = True

    monkeypatch.setattr(FakeWorker, "advance", stopping)
    actors = sup.Actors(lambda k: FakeServer(world, k), world.start_worker)
    checkpoints = sup.Checkpoints("fake://ckpt", 4, job=None, save_timeout=(60.0, "elastic.restore_timeout_s"))
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints)
    supervisor.run()
    [failure] = supervisor.failures
    assert failure.reason == "a server did not answer before the checkpoint save"
    assert (failure.kind, failure.target, failure.resumed_at, failure.from_checkpoint) == ("server", 0, 0, False)
    assert supervisor.logs.losses() == expected and supervisor.saved == [4, 8]


def test_a_server_that_never_starts_fails_the_job_at_the_first_step_limit_naming_it(world):
    from paramserver.hang_watch import HangLimits
    from paramserver.watchdog import ActorsNotStarted

    def stuck(k):  # placed on no CPU, or stuck in its constructor: it answers nothing
        server = FakeServer(world, k)
        server.sigstopped = k == 1
        return server

    with pytest.raises(ActorsNotStarted, match=r"server 1 did not start within 30 s \(elastic.first_step_timeout_s\)"):
        _run(world, start_server=stuck, hang=HangLimits(first_step_s=30.0))


def test_servers_that_do_not_answer_their_reopen_after_a_restore_fail_the_job_naming_the_limit(world, monkeypatch):
    from paramserver import restores
    from paramserver.checkpoint import ServersTimedOut

    supervisor = types.SimpleNamespace(servers=[FakeServer(world, k) for k in range(PAR.servers)],
                                       ckpt=types.SimpleNamespace(restore_timeout=(30.0, "elastic.restore_timeout_s")),
                                       history=types.SimpleNamespace(rewind=lambda step: None))
    supervisor.servers[1].sigstopped = True  # loaded, then stopped before its reopen
    monkeypatch.setattr(restores, "latest_commit", lambda sup: 4)
    monkeypatch.setattr(restores, "restore_from", lambda sup, step: step)
    with pytest.raises(ServersTimedOut, match=r"reopening at step 4: servers \[1\] did not finish within 30 s "
                                              r"\(elastic.restore_timeout_s\)"):
        restores.restore(supervisor)
