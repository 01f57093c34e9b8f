"""Parameter-server fault tolerance without Ray processes: the supervisor's decisions
(paramserver.recovery), the pull gate and a server actor's abort / reopen in one event loop, the
spec's ps faults, and the arithmetic a worker replacement relies on (a fresh worker of the same
index continues a bsp run bit for bit)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from chaos.config import FaultSpec
from orchestrator.spec.job_spec import SpecError, validate_spec
from paramserver.actors import ServerActor
from paramserver.clocks import UpdateRecord
from paramserver.gate import PullDropped, PullGate, SegmentStopped
from paramserver.lockstep import PSSetup, build_in_process, run_lockstep
from paramserver.messages import Push
from paramserver.recovery import Failure, Fault, FaultPlan, resume_step, segment_end
from paramserver.worker import PSWorker
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(preset="tiny", n_layers=1, d_model=16, d_ff=32, n_heads=2, vocab_size=32, max_seq_len=16)
DATA = DataConfig(seq_len=8)
TRAIN = TrainConfig(steps=6, global_batch=4, micro_batch=1, grad_clip=None, lr=3e-3)


def test_segments_end_at_the_checkpoint_cuts():
    assert [segment_end(s, 10, 4) for s in (0, 3, 4, 8, 9)] == [4, 4, 8, 10, 10]
    assert segment_end(0, 10, None) == segment_end(7, 10, None) == 10


def test_a_replacement_resumes_at_the_clock_every_server_agrees_on():
    assert resume_step([[5, 3], [5, 3], [5, 3]], worker=1) == 3
    assert resume_step([[5, 3], [5, 4]], worker=1) is None  # a torn push: server 1 has step 3, server 0 not
    assert resume_step([[5, 3], [4, 3]], worker=1) == 3  # another worker's torn push is not this one's


def test_faults_are_placed_by_pull_holds_and_fire_once():
    plan = FaultPlan([Fault("worker", 1, 3), Fault("server", 2, 5), Fault("worker", 0, 9)])
    assert plan.holds(0, 4, workers=2) == [(0, 1, 3)]
    assert plan.holds(4, 8, workers=2) == [(2, 0, 5), (2, 1, 5)]
    assert plan.due(0, [(1, 3)], 0, 4, 2) == [0] and plan.due(1, [(1, 3)], 0, 4, 2) == []
    assert plan.due(2, [(0, 5)], 4, 8, 2) == []  # a server dies once every worker is held there
    assert plan.due(2, [(0, 5), (1, 5)], 4, 8, 2) == [1]
    assert plan.fire(0) == Fault("worker", 1, 3)
    assert plan.holds(0, 4, 2) == [] and plan.due(0, [(1, 3)], 0, 4, 2) == []  # a rerun does not fire it again
    with pytest.raises(ValueError, match="fault kind"):
        Fault("node", 0, 1)


def test_a_failure_says_what_was_done():
    replaced = Failure("worker", 1, 100.0, "replaced", 99.5, resumed_at=3, pause_s=2.25)
    assert replaced.line() == "worker 1 died: replaced, resumed at step 3, pause 2.25 s, no global restart"
    restored = Failure("server", 0, 100.0, "restored", resumed_at=4, steps_redone=2)
    assert "from checkpoint step 4, 2 steps redone" in restored.line()
    reset = Failure("server", 0, 100.0, "restored", resumed_at=0, from_checkpoint=False)
    assert "the initial values (step 0)" in reset.line()
    assert replaced.to_dict()["pause_s"] == 2.25
    torn = Failure("torn_push", 1, 100.0, "restored", resumed_at=4, steps_redone=1)
    assert torn.line().startswith("worker 1 died between its pushes of one step to two servers: every server")


def test_one_rollback_of_two_dead_servers_counts_its_redone_steps_once():
    from paramserver.recovery import record_rollback, steps_redone

    failures, logs = [], {(w, s): None for w in (0, 1) for s in range(6)}
    record_rollback(failures, logs, {0, 2}, "servers 0 and 2 died", 100.0, None, step=4, from_checkpoint=True)
    assert [(f.target, f.steps_redone, f.rollback) for f in failures] == [(0, 2, 1), (2, 2, 1)]
    assert steps_redone(failures) == 2  # not 4: one rollback redid steps 4 and 5
    logs = {(w, s): None for w in (0, 1) for s in range(4, 7)}
    record_rollback(failures, logs, {1}, "server 1 died", 200.0, None, step=4, from_checkpoint=True)
    assert steps_redone(failures) == 2 + 3 and failures[-1].rollback == 2


def test_the_gate_holds_one_workers_pull_until_it_is_dropped():
    async def scenario():
        gate = PullGate()
        gate.hold(1, 3)
        await gate.wait(0, 3)  # another worker passes
        await gate.wait(1, 2)  # another step passes
        held = asyncio.ensure_future(gate.wait(1, 3))
        await asyncio.sleep(0)
        assert gate.held() == [(1, 3)] and not held.done()
        gate.drop(0)
        await asyncio.sleep(0)
        assert not held.done()
        gate.drop(1)
        with pytest.raises(PullDropped):
            await held
        assert gate.held() == []
        await gate.wait(1, 3)  # disarmed

    asyncio.run(scenario())


def _server(workers: int = 2):
    plain = ServerActor.__ray_actor_class__  # the actor's class, run here in one event loop
    setup = build_in_process(MODEL, DATA, TRAIN, ParallelConfig(dp=workers, mode="ps", servers=1))
    return plain(0, setup.servers[0].slices, MODEL, TRAIN, workers, "bsp")


def test_an_aborted_server_fails_waiting_pulls_and_pushes_and_reopen_forgets_the_undone_records():
    async def scenario():
        server = _server()
        waiting = asyncio.ensure_future(server.pull(0, 1, None))  # bsp: step 1 waits for every step-0 push
        await asyncio.sleep(0)
        assert not waiting.done()
        await server.abort()
        with pytest.raises(SegmentStopped):
            await waiting
        with pytest.raises(SegmentStopped):
            await server.push(Push(0, 0, 0, 0, 1))
        server.shard.records = [UpdateRecord(0, w, s, s, s, s) for s in range(3) for w in range(2)]
        sent = await server.stats(0)  # batch 1, whose answer the driver never gets
        server.shard.records = [UpdateRecord(0, w, 3, 3, 3, 3) for w in range(2)]
        await server.reopen(2)  # undoes steps 2 and later, sent or not
        assert server.shard.records == [] and not server.stopped
        again = await server.stats(0)
        assert sorted({r.step for r in again.records}) == [0, 1] and len(sent.records) == 6
        progress = await server.progress()
        assert (progress.server, progress.clocks) == (0, [0, 0])

    asyncio.run(scenario())


def test_a_fresh_worker_of_the_same_index_continues_a_bsp_run_bit_for_bit():
    torch.set_num_threads(1)
    par = ParallelConfig(dp=2, mode="ps", servers=2)
    reference = build_in_process(MODEL, DATA, TRAIN, par, 400)
    expected, _ = run_lockstep(reference, TRAIN.steps)
    faulty = build_in_process(MODEL, DATA, TRAIN, par, 400)
    losses, _ = run_lockstep(faulty, 3)
    # Worker 1 dies; its replacement holds nothing of its predecessor (data and dropout depend on
    # (seed, step, index) only; the parameters come with the pulls).
    fresh = PSWorker(1, 2, MODEL, DATA, TRAIN, [s.slices for s in faulty.servers])
    more, _ = run_lockstep(PSSetup(faulty.servers, [faulty.workers[0], fresh]), TRAIN.steps, start=3)
    assert losses + more == expected
    for mine, theirs in zip(faulty.servers, reference.servers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine.params, theirs.params, strict=True))


def _ps_spec(faults: list[dict], mode: str = "ps", **chaos) -> dict:
    parallel = {"dp": 2, "mode": "ps", "servers": 2} if mode == "ps" else {"dp": 2}
    return dict(name="ps", model={"preset": "tiny"}, data={"seq_len": 16},
                train={"steps": 6, "global_batch": 4, "grad_clip": None}, parallel=parallel,
                checkpoint={"url": "file:///tmp/undying-test-ps", "every_steps": 2, "async": False},
                chaos={"faults": faults, **chaos})


def _problems(raw: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        validate_spec(raw)
    return {p.field: p.message for p in err.value.problems}


def test_ps_mode_injects_kill_rank_and_kill_server_and_refuses_the_rest_naming_the_field():
    spec = validate_spec(_ps_spec([{"kind": "kill_rank", "rank": 1, "at_step": 3},
                                   {"kind": "kill_server", "server": 1, "at_step": 2}]))
    from orchestrator.cli.ps_run import supervision

    checkpoints, faults = supervision(spec)
    assert faults == [Fault("worker", 1, 3), Fault("server", 1, 2)]
    assert (checkpoints.every_steps, checkpoints.root) == (2, spec.checkpoint_root)
    assert (checkpoints.max_failed_saves, checkpoints.read_retry_s) == (spec.checkpoint.max_failed_saves,
                                                                        spec.checkpoint.read_retry_s)
    from orchestrator.cli.ps_run import capacity_problem

    need = spec.parallel.dp + spec.parallel.servers  # one CPU per actor
    assert capacity_problem(spec, {"CPU": float(need)}) is None
    problem = capacity_problem(spec, {"CPU": need - 1.0})
    assert problem.field == "parallel.servers" and f"= {need} CPU, but the cluster has {need - 1}" in problem.message
    refused = _problems(_ps_spec([{"kind": "slow_rank", "rank": 0, "at_step": 1, "factor": 2.0},
                                  {"kind": "kill_server", "server": 2, "at_step": 1},
                                  {"kind": "kill_rank", "rank": 0, "at_point": "before_step"},
                                  {"kind": "kill_rank", "rank": 0, "at_step": 1, "repeat": True}], mtbf_s=60))
    assert set(refused) == {"chaos.faults[0].kind", "chaos.faults[1].server", "chaos.faults[2].at_point",
                            "chaos.faults[2].at_step", "chaos.faults[3].repeat", "chaos.mtbf_s"}
    assert "use a server in 0..1" in refused["chaos.faults[1].server"]
    collective = _problems(_ps_spec([{"kind": "kill_server", "server": 0, "at_step": 1}], mode="collective"))
    assert "parallel.mode: ps" in collective["chaos.faults[0].kind"]


def test_kill_server_names_its_target_in_the_server_field():
    with pytest.raises(ValueError, match="add server"):
        FaultSpec(kind="kill_server", at_step=1)
    with pytest.raises(ValueError, match="server names the target of kill_server and hang_server only"):
        FaultSpec(kind="kill_rank", rank=0, server=1, at_step=1)
    assert FaultSpec(kind="kill_server", server=1, at_step=1).server == 1


def test_a_resumed_ps_job_carries_the_goodput_its_checkpoint_saved(tmp_path):
    import time

    from ckpt.catalog import Catalog
    from ckpt.storage import Storage
    from monitor.goodput import GoodputLedger
    from orchestrator.cli.ps_run import carry_goodput
    from tests._checkpoints import shard_receipts

    raw = _ps_spec([])
    raw["checkpoint"] = {**raw["checkpoint"], "url": f"file://{tmp_path}/ckpt"}
    spec = validate_spec(raw)
    fresh = GoodputLedger()
    carry_goodput(spec, fresh, time.time(), None)  # nothing committed: nothing carried
    assert sum(fresh.carried.values()) == 0
    catalog = Catalog(Storage(spec.checkpoint_root))
    saved = {"startup": 3.0, "productive": 40.0, "checkpoint_save": 2.0}
    catalog.commit(job="ps", step=4, generation=0, layout={"dp": 2}, spec_hash="h",
                   receipts=shard_receipts(catalog, 4, {"w": torch.ones(4)}),
                   state={"engine": {"next_step": 4}, "goodput": saved})
    committed_at = catalog.read_manifest(4).created_at
    ledger = GoodputLedger()
    snapshots, _ = carry_goodput(spec, ledger, committed_at + 60.0, None)  # started a minute after the commit
    assert {k: ledger.carried[k] for k in saved} == saved
    assert ledger.carried["other"] == pytest.approx(60.0)  # its driver died: no driver ran since the commit
    # A driver that ended on its own (preempted at that commit) wrote its end: an hour's wait before the
    # rerun is the operator's, not the job's, as for a collective job.
    ended = GoodputLedger(carried={**saved, "productive": 41.0})
    ended.stop()
    snapshots.save(ended, ended=True)
    again = GoodputLedger()
    carry_goodput(spec, again, committed_at + 3600.0, None)
    assert again.carried["other"] == pytest.approx(0.0, abs=0.01)
    assert again.carried["lost_work"] == pytest.approx(1.0, abs=0.01)  # trained past the commit, rolled back


def test_a_resumed_ps_job_whose_restore_lands_older_than_the_carried_commit_books_the_work_between(tmp_path):
    """Step 8's ledger is carried, step 8 proves corrupt and the servers restore step 4: the job's work
    between the two commits is redone, lost work, not productive twice (as for a collective job)."""
    import time
    from types import SimpleNamespace

    from ckpt.catalog import Catalog
    from ckpt.storage import Storage
    from monitor.goodput import GoodputLedger
    from orchestrator.cli.ps_run import carry_goodput
    from tests._checkpoints import shard_receipts

    raw = _ps_spec([])
    raw["checkpoint"] = {**raw["checkpoint"], "url": f"file://{tmp_path}/ckpt"}
    spec = validate_spec(raw)
    catalog = Catalog(Storage(spec.checkpoint_root))
    for step, productive in ((4, 40.0), (8, 90.0)):
        catalog.commit(job="ps", step=step, generation=0, layout={"dp": 2}, spec_hash="h",
                       receipts=shard_receipts(catalog, step, {"w": torch.ones(4)}),
                       state={"engine": {"next_step": step}, "goodput": {"productive": productive}})
    ledger, checkpoints = GoodputLedger(), SimpleNamespace(on_resumed=None)
    carry_goodput(spec, ledger, time.time(), None, checkpoints)
    checkpoints.on_resumed(4)
    assert ledger.totals()["lost_work"] == pytest.approx(50.0) and ledger.totals()["productive"] == pytest.approx(40.0)
