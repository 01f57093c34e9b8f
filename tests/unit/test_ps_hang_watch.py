"""The parameter-server hang watchdog's decisions (paramserver.hang_watch) on a fake clock, its limits
as the driver derives them from the spec (orchestrator.cli.ps_run.hang_limits), and the spec's
hang_rank for ps jobs. The real thing (a stopped worker replaced, a stopped server rolled back) runs
in tests/ray/test_ps_hangs.py."""

from __future__ import annotations

import pytest

from orchestrator.spec.job_spec import SpecError, validate_spec
from paramserver.hang_watch import PROBE_S, HangLimits, HangWatch
from paramserver.recovery import Failure, Fault


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(workers: int = 2, **limits) -> tuple[HangWatch, Clock]:
    clock = Clock()
    watch = HangWatch(HangLimits(**{"floor_s": 10.0, "factor": 5.0, "first_step_s": 120.0, **limits}), clock)
    for w in range(workers):
        watch.started(w)
        watch.launched(w, 0)
    return watch, clock


def _steps(watch: HangWatch, clock: Clock, workers, steps, every_s: float = 1.0) -> None:
    for step in steps:
        clock.now += every_s
        for w in workers:
            watch.landed(w, step, clock.now)


def test_a_new_actor_has_the_first_step_limit_then_the_steady_one():
    watch, clock = _watch()
    clock.now += 119.0  # building the model, a cold start: no hang yet
    assert watch.suspects() == [] and watch.limit(0) == (120.0, "elastic.first_step_timeout_s")
    clock.now += 1.0
    assert watch.suspects() == [0, 1] and [w for w, _ in watch.hung_workers()] == [0, 1]
    _steps(watch, clock, [0, 1], range(3))
    assert watch.limit(0) == (10.0, "elastic.hang_timeout_s")  # 5 x the 1 s median is below the floor
    _steps(watch, clock, [0, 1], range(3, 8), every_s=4.0)
    assert watch.median_step_s() == 4.0 and watch.limit(1) == (20.0, "elastic.hang_timeout_s")


def test_the_stopped_worker_is_blamed_not_the_ones_waiting_for_it():
    watch, clock = _watch(workers=3)
    _steps(watch, clock, [0, 1, 2], range(4))
    # bsp: worker 1 stops in step 4; the others finish step 4 and wait in their pulls of step 5.
    _steps(watch, clock, [0, 2], [4])
    clock.now += 30.0
    assert watch.suspects() == [1]
    (w, why), = watch.hung_workers()
    assert w == 1 and "worker 1 made no step for 31.0 s (elastic.hang_timeout_s 10.0 s)" in why
    assert watch.silent_since(1) == 1004.0  # its last step: the hang's detection is booked from there


def test_a_finished_worker_is_out_of_the_race_and_a_new_actor_starts_over():
    watch, clock = _watch()
    _steps(watch, clock, [0, 1], range(2))
    watch.ended(0)  # asp: worker 0 ran its segment to the end; worker 1 is behind, alone
    _steps(watch, clock, [1], [2])
    clock.now += 11.0
    assert watch.suspects() == [1]
    watch.ended(1)
    watch.started(1)  # its replacement builds the model: the first-step limit again
    watch.launched(1, 3)
    assert watch.suspects() == [] and watch.limit(1)[1] == "elastic.first_step_timeout_s"
    watch.launched(0, 4)  # the next segment: worker 0 keeps its actor, the steady limit
    assert watch.limit(0)[1] == "elastic.hang_timeout_s"


def test_a_live_worker_may_wait_out_a_data_outage_but_a_stopped_one_fails_its_probe():
    watch, clock = _watch(outage_s=120.0)
    _steps(watch, clock, [0, 1], range(3))
    clock.now += 10.0
    assert watch.to_probe() == [0, 1] and watch.to_probe() == []  # one outstanding probe each
    watch.probe_answered(0)  # worker 0 lives (its reads are being retried); worker 1 is stopped
    clock.now += PROBE_S
    assert [w for w, _ in watch.hung_workers()] == [1]
    assert "did not answer a probe for 5 s" in watch.hung_workers()[0][1]
    assert watch.to_probe() == [0]  # probed again: it may stop during the outage
    watch.probe_answered(0)
    clock.now += 120.0 - PROBE_S - 0.1
    assert [w for w, _ in watch.hung_workers()] == [1]
    clock.now += 0.1  # past the outage allowance too: alive, but no step comes
    assert [w for w, _ in watch.hung_workers()] == [0, 1]
    assert "and answers, but made no step" in dict(watch.hung_workers())[0]


def test_a_server_is_hung_when_its_progress_call_is_unanswered_for_the_steady_limit():
    watch, clock = _watch()
    asked = clock.now
    clock.now += 9.9
    assert watch.server_hung(asked) is None
    clock.now += 0.1
    assert watch.server_hung(asked) == "did not answer a progress call for 10.0 s (elastic.hang_timeout_s 10.0 s)"
    assert watch.server_hung(asked, started=True) is None  # a new actor building its shard: the first-step limit
    clock.now += 110.0
    assert watch.server_hung(asked, started=True).endswith("(elastic.first_step_timeout_s 120.0 s)")


def test_a_steady_straggler_is_slow_not_hung():
    watch, clock = _watch(workers=3)
    for step in range(40):  # asp: workers 0 and 1 step every second, worker 2 every 12 s
        clock.now += 1.0
        for w in (0, 1):
            watch.landed(w, step, clock.now)
        if step % 12 == 11:
            watch.landed(2, step // 12, clock.now)
    assert watch.median_step_s() == 1.0 and watch.median_step_s(2) == 12.0
    assert watch.limit(2) == (60.0, "elastic.hang_timeout_s") and watch.limit(0)[0] == 10.0
    clock.now += 55.0
    assert watch.suspects() == []  # worker 2 is the lowest, 59 s after its last step: within its own 60 s
    clock.now += 1.0
    assert watch.suspects() == [2]
    (_, why), = watch.hung_workers()
    assert why.endswith("(elastic.hang_timeout_s 60.0 s)")  # no probe awaited: no word of one


def test_an_explicit_limit_replaces_the_derived_one():
    watch, clock = _watch(floor_s=3.0, factor=0.0, first_step_s=7.0)
    clock.now += 7.0
    assert watch.suspects() == [0, 1]
    _steps(watch, clock, [0, 1], range(5), every_s=2.0)
    assert watch.limit(0) == (3.0, "elastic.hang_timeout_s")  # not 5 x the 2 s median
    assert HangLimits(3.0, 0.0, 7.0, 60.0).describe() == "hang 3 s, first step 7 s, a live worker 60 s more " \
                                                          "(data.read_retry_s)"


def _spec(**sections) -> dict:
    return {"name": "ps", "model": {"preset": "tiny"}, "data": {"seq_len": 16},
            "train": {"steps": 6, "global_batch": 4, "grad_clip": None},
            "parallel": {"dp": 2, "mode": "ps", "servers": 2},
            "checkpoint": {"url": "file:///tmp/undying-test-ps", "every_steps": 2}, **sections}


def test_the_driver_derives_the_limits_from_the_elastic_section_and_maps_hang_rank():
    from orchestrator.cli.ps_run import hang_limits, supervision

    auto = hang_limits(validate_spec(_spec()))
    assert (auto.floor_s, auto.factor, auto.first_step_s, auto.outage_s) == (10.0, 5.0, 120.0, 0.0)
    hangs = [{"kind": "hang_rank", "rank": 1, "at_step": 3}, {"kind": "hang_server", "server": 1, "at_step": 2}]
    spec = validate_spec(_spec(elastic={"hang_timeout_s": 4, "first_step_timeout_s": 30}, chaos={"faults": hangs}))
    assert hang_limits(spec) == HangLimits(4.0, 0.0, 30.0, 0.0)
    assert supervision(spec)[1] == [Fault("worker_hang", 1, 3), Fault("server_hang", 1, 2)]
    with pytest.raises(SpecError) as err:  # a server that does not exist, a collective job's server
        validate_spec(_spec(chaos={"faults": [{"kind": "hang_server", "server": 2, "at_step": 2}]}))
    assert {p.field for p in err.value.problems} == {"chaos.faults[0].server"}
    collective = {**_spec(chaos={"faults": hangs[1:]}), "parallel": {"dp": 2}}
    with pytest.raises(SpecError, match="hang_server acts on a parameter server, which only parallel.mode ps has"):
        validate_spec(collective)
    tokens = _spec(data={"source": "tokens", "path": "file:///tmp/undying-test-ps-data", "seq_len": 16,
                         "read_retry_s": 45})
    assert hang_limits(validate_spec(tokens)).outage_s == 45.0


def test_a_hung_actor_says_so_in_the_report():
    failure = Failure("worker", 1, 0.0, "replaced", resumed_at=4, pause_s=1.5,
                      hung="worker 1 made no step for 12.0 s (elastic.hang_timeout_s 10.0 s)")
    assert failure.line().startswith("worker 1 made no step for 12.0 s (elastic.hang_timeout_s 10.0 s) (hung): "
                                     "replaced, resumed at step 4")
    with pytest.raises(ValueError, match="expected one of worker, worker_hang, server, server_hang"):
        Fault("stop", 0, 1)


def test_a_worker_that_waited_for_a_replacement_is_not_blamed_for_the_wait():
    watch, clock = _watch()
    _steps(watch, clock, [0, 1], range(6))
    _steps(watch, clock, [0], [6])  # worker 1 stops in step 6; worker 0 waits in its pull of 7
    clock.now += 5.0
    watch.ended(1)  # killed as hung; its replacement builds the model for 4 s and catches up
    watch.started(1)
    watch.launched(1, 6)
    clock.now += 4.0
    watch.landed(1, 6, clock.now)
    # Both at step 7 now: worker 0's 9 s in its pull were worker 1's, its own silence starts here.
    assert watch.suspects() == []
    clock.now += 9.9
    assert watch.suspects() == []
    clock.now += 0.1
    assert watch.suspects() == [0, 1]


def test_servers_that_do_not_finish_their_load_in_time_are_named(monkeypatch):
    import types

    from paramserver import checkpoint

    answered = {"k0", "k2"}  # server 1's load hangs
    servers = [types.SimpleNamespace(load_shard=types.SimpleNamespace(remote=lambda *a, k=k, **kw: f"k{k}"))
               for k in range(3)]
    waits = []

    def wait(refs, num_returns, timeout):
        waits.append((num_returns, timeout))
        return [r for r in refs if r in answered], [r for r in refs if r not in answered]

    monkeypatch.setattr(checkpoint, "ray", types.SimpleNamespace(wait=wait, get=lambda refs: refs))
    with pytest.raises(checkpoint.ServersTimedOut) as err:
        checkpoint.restore_servers(servers, "file:///ckpt", 8, timeout=(42.0, "elastic.restore_timeout_s"))
    assert err.value.servers == [1] and waits == [(3, 42.0)]
    assert str(err.value) == ("the restore of checkpoint step 8: servers [1] did not finish within 42 s "
                              "(elastic.restore_timeout_s)")
    assert isinstance(err.value, checkpoint.PSCheckpointError)  # a save that times out fails, the job goes on
    answered.add("k1")
    assert checkpoint.restore_servers(servers, "file:///ckpt", 8, timeout=(42.0, "x")) == ["k0", "k1", "k2"]


def test_the_restore_and_save_limits_and_the_elastic_fields_ps_mode_does_not_read():
    from orchestrator.cli.ps_run import io_timeouts

    (save, why), (restore, setting) = io_timeouts(validate_spec(_spec()))
    assert setting == "elastic.restore_timeout_s" and restore == pytest.approx(save + 120.0)  # + read_retry_s
    assert 120.0 < save < 121.0 and why.startswith("a ps save's limit, 120 s + 3 x its")
    assert io_timeouts(validate_spec(_spec(elastic={"restore_timeout_s": 900}))) == (
        (900.0, "elastic.restore_timeout_s"), (900.0, "elastic.restore_timeout_s"))
    read = {"max_restarts": 4, "restart_window_s": 600, "crash_loop_limit": 5, "hang_timeout_s": 30,
            "first_step_timeout_s": 300, "restore_timeout_s": 900, "preemption_grace_s": 20, "spares": 0}
    validate_spec(_spec(elastic=read))
    unread = {"min_dp": 2, "spares": 1, "replace_timeout_s": 5, "grow": False, "evict_stragglers": True,
              "collective_timeout_s": 600, "release_timeout_s": 9}
    with pytest.raises(SpecError) as err:
        validate_spec(_spec(elastic=unread))
    problems = {p.field: p.message for p in err.value.problems}
    assert problems.keys() == {f"elastic.{name}" for name in unread}
    assert problems["elastic.grow"] == "is not read by parallel.mode ps (nothing shrinks in parallel.mode ps, " \
                                       "so nothing grows back); remove it"


def test_resources_and_trackers_a_ps_job_would_not_honour_are_refused_by_field():
    from orchestrator.spec.job_spec import SpecError, validate_spec

    unread = {"resources": {"gpus_per_rank": 1, "cpus_per_rank": 4, "custom": {"accelerator_type:H100": 1},
                            "placement": "spread"},
              "monitor": {"tensorboard": "/tmp/tb", "wandb": {"project": "p"}}}
    with pytest.raises(SpecError) as err:
        validate_spec(_spec(**unread))
    problems = {p.field: p.message for p in err.value.problems}
    assert problems.keys() == {"resources.gpus_per_rank", "resources.cpus_per_rank", "resources.custom",
                               "resources.placement", "monitor.tensorboard", "monitor.wandb"}
    assert "one actor of one CPU" in problems["resources.gpus_per_rank"]
    assert "its report, --report, and its Prometheus series" in problems["monitor.wandb"]
    validate_spec(_spec(resources={"num_ranks": 2}))  # a check of the layout, not a request: read


def test_compile_recompute_and_buckets_a_ps_worker_would_not_apply_are_refused_by_field():
    from orchestrator.spec.job_spec import SpecError, validate_spec

    spec = _spec()
    spec["train"] = {**spec["train"], "compile": True}
    spec["parallel"] = {**spec["parallel"], "recompute": "block", "ddp_bucket_mb": 50}
    with pytest.raises(SpecError) as err:
        validate_spec(spec)
    problems = {p.field: p.message for p in err.value.problems}
    assert problems.keys() == {"train.compile", "parallel.recompute", "parallel.ddp_bucket_mb"}
    assert "keep every activation" in problems["parallel.recompute"]
    validate_spec(_spec(parallel={"dp": 2, "mode": "ps", "servers": 2, "recompute": "none"}))  # the default: read
