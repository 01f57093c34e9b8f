"""`undying chaos` without Ray: a fake runner leaves checkpoints and a report, the real checks judge them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from monitor.report import FailureRecord, FaultRecord, GoodputSummary, LossPoint, RunReport, WorldRecord
from orchestrator.cli.chaos.command import chaos_main
from orchestrator.cli.chaos.experiment import catalog_of
from orchestrator.cli.chaos.runs import RunOutcome
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from orchestrator.cli.main import _parser, main
from orchestrator.spec.job_spec import load_spec, spec_hash
from tests._checkpoints import save_checkpoint

STEPS = 4


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the PID names no process
    return proc.pid


class FakeRunner:
    """Writes a committed final checkpoint of `model/w` and returns a report, as a finished job would.

    `history` and `weights` of the chaos run (not the reference) can be spoiled to make a check fail."""

    def __init__(self, history=None, weights=None, fired=True, digests=True):
        self.history = history if history is not None else [[s, 4] for s in range(STEPS)]
        self.weights, self.fired = weights, fired  # fired: the random kill (fault id 0) reached the run
        self.digests = digests  # the ranks' sample digests in the history, as every commit carries them
        self.names: list[str] = []

    def __call__(self, spec, *, address, report_path) -> RunOutcome:
        self.names.append(spec.name)
        reference = spec.name.endswith(".reference")
        weights = self.weights if self.weights is not None and not reference else torch.ones(3, 2)
        save_checkpoint(catalog_of(spec), spec.train.steps, {"model/w": weights, "optim/w/step": torch.tensor(1.0)},
                        world=2, spec_hash=spec_hash(spec))
        totals = {"productive": 8.0, "startup": 1.5, "lost_work": 0.5}
        report = RunReport(job=spec.name, final_step=spec.train.steps, status="succeeded",
                           history=_with_digests(spec, [[s, 4] for s in range(STEPS)]) if reference else
                           _with_digests(spec, self.history) if self.digests else self.history,
                           world_history=[WorldRecord(generation=0, world_size=4, dp=4, tp=1, pp=1, started_at=0.0)],
                           goodput=GoodputSummary.from_totals(totals).model_copy(update={"clock_wall_s": 10.0}),
                           faults=[FaultRecord(time=3.0, kind="kill_rank", fault_id=0, rank=1, step=2)]
                           if self.fired and not reference else [])
        return RunOutcome(EXIT_OK, report, {"rank 0 pid": _gone_pid()}, wall_s=12.0)


def _with_digests(spec, history: list) -> list:
    """`history` with the digest of every sample of steps 0..STEPS-1, as the ranks report them at a commit."""
    from trainer.batch import SampleDigest
    from trainer.data import make_cursor

    cursor = make_cursor(spec.data, spec.model.vocab_size)
    digest = SampleDigest.of(0, [cursor.sample_keys(step, spec.train.global_batch) for step in range(STEPS)])
    return [*history, ["samples", 0, STEPS, digest.count, digest.total]]


def _args(tmp_path, *extra: str):
    return _parser().parse_args(["chaos", "examples/demo.yaml", "--mtbf", "30s", "--kind", "kill_rank",
                                 "--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--set", f"train.steps={STEPS}",
                                 "--set", "name=unit", "--set", "chaos.faults=[]",
                                 "--report", str(tmp_path / "out.json"), "--timeline", str(tmp_path / "t.png"), *extra])


def test_every_check_passes_and_the_report_holds_them(tmp_path, capsys):
    runner = FakeRunner()
    assert chaos_main(_args(tmp_path), runner=runner) == EXIT_OK
    assert runner.names == ["unit.reference", "unit"]  # the reference first, under its own name
    out = capsys.readouterr().out
    for name in ("checkpoints_verify", "newest_loads", "model_matches_reference", "data_exactly_once",
                 "goodput_sums_to_wall", "no_process_left", "faults_fired", "goodput_wall_plausible"):
        assert f"PASS  {name}" in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["invariants"]["ok"] is True and saved["final_step"] == STEPS
    assert saved["experiment"]["chaos"]["mtbf_s"] == 30.0 and saved["experiment"]["chaos"]["mtbf_kind"] == "kill_rank"
    # A second experiment reuses the finished reference, and refuses to resume the old chaos run.
    again = FakeRunner()
    assert chaos_main(_args(tmp_path), runner=again) == EXIT_USAGE and again.names == []
    assert "already holds checkpoints" in capsys.readouterr().err
    # --fresh deletes nothing while a job runs in the experiment's folder.
    from ckpt.ownership import OwnerLease

    catalog = catalog_of(load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"]))
    running, before = OwnerLease.claim(catalog.storage, "a run", 60.0), catalog.all_steps()
    assert chaos_main(_args(tmp_path, "--fresh"), runner=again) == EXIT_USAGE and "unit" not in again.names
    assert "belongs to a running job: a run on host" in capsys.readouterr().err and catalog.all_steps() == before
    running.release()
    again = FakeRunner()
    assert chaos_main(_args(tmp_path, "--fresh"), runner=again) == EXIT_OK and again.names == ["unit.reference", "unit"]


def test_fresh_deletes_nothing_of_a_holder_whose_clock_is_far_behind_while_its_beat_advances(tmp_path, capsys):
    # The experiment's job runs on another host whose clock is 11 minutes behind: by the wall clocks
    # its last beat is past the stale limit, but the beat counter advances, so it runs.
    import threading
    import time

    from ckpt.owner_claims import OWNER_DIR, STALE_FLOOR_S, epochs, file_name

    assert chaos_main(_args(tmp_path), runner=FakeRunner()) == EXIT_OK
    catalog = catalog_of(load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"]))
    storage, epoch, lease_s = catalog.storage, max(epochs(catalog.storage), default=-1) + 1, 1.2
    record = {"holder": "undying run of job 'unit'", "lease_s": lease_s, "claimed_at": time.time() - 3600,
              "process": {"host": "node-7/boot/pid:[1]", "pid": 4242, "started": "1"}}
    storage.create_exclusive(storage.path(OWNER_DIR, file_name("claim", epoch)), json.dumps(record).encode())
    stop, before = threading.Event(), catalog.all_steps()

    def beat() -> None:
        n = 0
        while n == 0 or not stop.wait(lease_s / 6):
            n += 1
            beat = {"beat": n, "time": time.time() - STALE_FLOOR_S - 60, "ended": False}
            storage.write_immutable(storage.path(OWNER_DIR, file_name("beat", epoch)), json.dumps(beat).encode())

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        assert chaos_main(_args(tmp_path, "--fresh"), runner=FakeRunner()) == EXIT_USAGE
    finally:
        stop.set()
        beating.join()
    err = capsys.readouterr().err
    assert "belongs to a running job" in err and "heartbeat advanced" in err and catalog.all_steps() == before


def test_fresh_never_deletes_checkpoints_no_experiment_made(tmp_path, capsys):
    """`undying chaos --fresh` pointed at a job that `undying run` trained (no experiment's marker)."""
    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"])
    catalog = catalog_of(spec)
    save_checkpoint(catalog, 2, {"model/w": torch.ones(3, 2)}, world=1)
    runner = FakeRunner()
    assert chaos_main(_args(tmp_path, "--no-reference"), runner=runner) == EXIT_USAGE
    err = capsys.readouterr().err  # --fresh would not delete them: it is not offered
    assert "already holds checkpoints" in err and "--fresh" not in err and "--set name=" in err
    assert chaos_main(_args(tmp_path, "--fresh", "--no-reference"), runner=runner) == EXIT_USAGE
    assert runner.names == [] and catalog.committed_steps() == [2]
    err = capsys.readouterr().err
    assert "no `undying chaos` experiment made" in err and "--fresh leaves them" in err


def test_a_job_run_in_an_experiment_s_root_takes_it_over_and_fresh_then_leaves_it(tmp_path, capsys):
    """`undying run` of the spec an experiment used, in the root the experiment made: from its claim on
    the root is the job's, so a later `chaos --fresh` must not delete the job's commits."""
    from orchestrator.cli.root_lease import claim_root, took_over

    assert chaos_main(_args(tmp_path, "--no-reference"), runner=FakeRunner()) == EXIT_OK
    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"])
    storage = catalog_of(spec).storage
    claim_root(spec).release()  # a claim alone (an experiment's run, a run refused at its start) keeps it
    assert storage.exists(storage.path("chaos-experiment.json"))
    capsys.readouterr()
    lease = claim_root(spec)
    assert took_over(spec)  # a run about to train
    lease.release()
    assert not storage.exists(storage.path("chaos-experiment.json"))
    assert "it is this job's root now" in capsys.readouterr().out
    runner = FakeRunner()
    assert chaos_main(_args(tmp_path, "--fresh", "--no-reference"), runner=runner) == EXIT_USAGE
    assert runner.names == [] and catalog_of(spec).committed_steps() == [STEPS]
    assert "no `undying chaos` experiment made" in capsys.readouterr().err


def test_a_job_s_root_without_checkpoints_yet_is_not_marked_as_an_experiment_s(tmp_path, capsys):
    # A running job before its first commit (its lease and event log there): a marker written now
    # would let a later --fresh delete the checkpoints that job commits.
    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"])
    storage = catalog_of(spec).storage
    storage.write_immutable(storage.path("owner", "claim-1.json"), b"{}")
    assert chaos_main(_args(tmp_path, "--no-reference"), runner=FakeRunner()) == EXIT_USAGE
    assert not storage.exists(storage.path("chaos-experiment.json")) and "holds owner" in capsys.readouterr().err


@pytest.mark.parametrize("spoil, failing", [
    ({"history": [[0, 4], [1, 4], ["restore", 1], [2, 4], [3, 4]]}, "data_exactly_once"),  # step 1 rolled back
    ({"weights": torch.ones(3, 2) + 1e-3}, "model_matches_reference"),
    ({"fired": False}, "faults_fired"),  # the MTBF reached no step of the run: it tested nothing
    ({"digests": False}, "data_exactly_once"),  # no report of what the ranks consumed: nothing to check
])
def test_a_failed_invariant_exits_non_zero(tmp_path, capsys, spoil, failing):
    assert chaos_main(_args(tmp_path), runner=FakeRunner(**spoil)) == EXIT_FAILED
    out = capsys.readouterr().out
    assert f"FAIL  {failing}" in out and "1 check(s) FAILED" in out
    assert json.loads((tmp_path / "out.json").read_text())["invariants"]["ok"] is False


def test_usage_mistakes_exit_2_before_anything_runs(tmp_path, capsys):
    runner = FakeRunner()
    no_faults = _parser().parse_args(["chaos", "examples/demo.yaml", "--set", "chaos.faults=[]",
                                      "--set", f"checkpoint.url=file://{tmp_path}/ckpt"])
    assert chaos_main(no_faults, runner=runner) == EXIT_USAGE
    assert "chaos.mtbf_s" in capsys.readouterr().err
    not_sweep = _args(tmp_path, "--intervals", "5s")
    assert chaos_main(not_sweep, runner=runner) == EXIT_USAGE
    for flags, named in ((["--mtbf", "abc"], "--mtbf (chaos.mtbf_s)"),
                         (["--start", "10s"], "--start (chaos.mtbf_start_s)")):
        argv = ["chaos", "examples/demo.yaml", *flags, "--set", f"checkpoint.url=file://{tmp_path}/ckpt"]
        assert chaos_main(_parser().parse_args(argv), runner=runner) == EXIT_USAGE
        assert named in capsys.readouterr().err  # the flag the user gave, beside the field it sets
    bad = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "30s", "--intervals", "5s,soon"])
    assert chaos_main(bad, runner=runner) == EXIT_USAGE
    assert "'soon'" in capsys.readouterr().err and runner.names == []
    for argv in (["chaos", "sweep", "examples/demo.yaml", "--mtbf", "30s", "--intervals", "5s", "--step-s", "0"],
                 ["chaos", "examples/demo.yaml", "--step-s", "0"]):
        assert chaos_main(_parser().parse_args(argv), runner=runner) == EXIT_USAGE
        assert "--step-s" in capsys.readouterr().err and runner.names == []
    for flag in (["--report", str(tmp_path / "r.json")], ["--no-reference"]):  # a sweep would ignore them
        argv = ["chaos", "sweep", "examples/demo.yaml", "--mtbf", "30s", "--intervals", "5s", *flag]
        assert chaos_main(_parser().parse_args(argv), runner=runner) == EXIT_USAGE
        err = capsys.readouterr().err
        assert flag[0] in err and "belong to a single experiment" in err
    # A root holding another run's checkpoints is refused before the reference run, not after it.
    save_checkpoint(catalog_of(load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt",
                                                               "name=unit"])), 2, {"model/w": torch.ones(3, 2)})
    assert chaos_main(_args(tmp_path), runner=runner) == EXIT_USAGE
    assert "already holds checkpoints" in capsys.readouterr().err and runner.names == []


def test_sweep_runs_each_interval_under_the_same_failures_and_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from monitor.report import CheckpointRecord, FailureRecord, LossPoint

    seen = []

    def runner(spec, *, address, report_path) -> RunOutcome:
        seen.append(spec)
        every = spec.checkpoint.every_steps or 8
        report = RunReport(
            job=spec.name, final_step=spec.train.steps, status="succeeded",
            losses=[LossPoint(step=s, loss=1.0, time=10.0 + 0.25 * s) for s in range(spec.train.steps)],
            checkpoints=[CheckpointRecord(step=s, committed_at=10.0 + 0.25 * s, bytes=1, blocking_s=0.1, total_s=0.2)
                         for s in range(every, spec.train.steps + 1, every)],
            failures=[FailureRecord(time=30.0, kind="kill_rank", rank=1, detected_after_s=0.05,
                                    recovered_after_s=3.0, first_step_after_s=3.2)],
            goodput=GoodputSummary.from_totals({"productive": 40.0 - abs(every - 16) / 10, "startup": 10.0,
                                                "lost_work": 2.0}))
        return RunOutcome(EXIT_OK, report, {}, wall_s=60.0)

    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "120s", "--kind", "kill_rank",
                                 "--intervals", "1s,4s,young", "--set", "chaos.faults=[]",
                                 "--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--set", "train.steps=40",
                                 "--out", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png")])
    assert chaos_main(args, runner=runner) == EXIT_OK
    # Without --levels, the spec's own level: demo.yaml's memory level is on.
    assert [s.name for s in seen] == ["demo.sweep-calibrate", *(f"demo.sweep-{i}.two-level" for i in ("1s", "4s",
                                                                                                      "young"))]
    assert all(s.checkpoint.memory.enabled for s in seen[1:])
    assert [s.checkpoint.every_steps for s in seen[1:]] == [4, 16, None]  # 0.25 s per step, measured
    assert seen[1].chaos == seen[2].chaos == seen[3].chaos and seen[0].chaos.mtbf_s is None
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["label"] for r in saved["rows"]] == ["1s", "4s", "young"] and saved["system_mtbf_s"] == 30.0
    assert saved["summary"]["best_fixed"]["label"] == "4s"
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "tau* = sqrt(2 C M) = 2.4 s" in capsys.readouterr().out  # sqrt(2 * 0.1 * 30)


def test_sweep_levels_run_each_interval_with_and_without_the_memory_level(tmp_path, capsys):
    from monitor.report import CheckpointRecord, FailureRecord

    seen = []

    def runner(spec, *, address, report_path) -> RunOutcome:
        seen.append(spec)
        memory = spec.checkpoint.memory.enabled
        report = RunReport(
            job=spec.name, final_step=spec.train.steps, status="succeeded",
            checkpoints=[CheckpointRecord(step=s, committed_at=s, bytes=1, blocking_s=0.1, total_s=0.2)
                         for s in (10, 20)],
            failures=[FailureRecord(time=30.0, kind="kill_rank", rank=1, detected_after_s=0.05, recovered_after_s=1.0,
                                    restore_level="memory" if memory else "storage")],
            goodput=GoodputSummary.from_totals({"productive": 45.0 if memory else 40.0, "lost_work": 1.0}))
        return RunOutcome(EXIT_OK, report, {}, wall_s=50.0)

    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "120s", "--kind", "kill_rank",
                                 "--intervals", "young", "--levels", "storage,two-level", "--step-s", "0.25",
                                 "--set", "chaos.faults=[]", "--set", f"checkpoint.url=file://{tmp_path}/ckpt",
                                 "--set", "train.steps=40", "--out", str(tmp_path / "sweep.json")])
    assert chaos_main(args, runner=runner) == EXIT_OK
    assert [s.name for s in seen] == ["demo.sweep-young", "demo.sweep-young.two-level"]
    assert [s.checkpoint.memory.enabled for s in seen] == [False, True] and seen[0].chaos == seen[1].chaos
    saved = json.loads((tmp_path / "sweep.json").read_text())
    gain = saved["summary"]["two_level_vs_storage"]["young"]
    assert gain["goodput_points"] == pytest.approx(100 * (45 / 46 - 40 / 41))
    assert gain["wall_change"] == pytest.approx(46 / 41 - 1)  # the same steps: the like-for-like figure
    assert "interval young: two-level +" in capsys.readouterr().out
    seen.clear()  # one level asked for is that level, not the spec's (whose memory level is on)
    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "120s", "--kind", "kill_rank",
                                 "--intervals", "young", "--levels", "storage", "--step-s", "0.25", "--fresh",
                                 "--set", "chaos.faults=[]", "--set", f"checkpoint.url=file://{tmp_path}/ckpt",
                                 "--set", "train.steps=40"])
    assert chaos_main(args, runner=runner) == EXIT_OK
    assert [(s.name, s.checkpoint.memory.enabled) for s in seen] == [("demo.sweep-young", False)]


def test_random_node_kills_never_target_the_controllers_node(tmp_path):
    from ckpt.storage import Storage
    from orchestrator.wire.store import RendezvousServer
    from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec

    rendezvous = RendezvousServer("127.0.0.1")
    spec = _spec(tmp_path, chaos={"mtbf_s": 5, "mtbf_kind": "kill_node"})  # every fake rank runs on "head"
    report = _controller(spec, FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root)), rendezvous, []).run()
    assert report.status == "failed" and "would kill the controller" in report.error and not report.failures


def test_without_kind_one_node_gets_rank_kills_and_several_nodes_keep_node_kills(tmp_path, capsys, monkeypatch):
    from orchestrator.cli.chaos.default_kind import with_default_kind

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kinds = []

    class KindRecorder(FakeRunner):
        def __call__(self, spec, **kw):
            kinds.append(spec.chaos.mtbf_kind)
            return super().__call__(spec, **kw)

    args = _args(tmp_path)
    args.kind = None
    assert chaos_main(args, runner=KindRecorder()) == EXIT_OK  # no --address: embedded Ray, one node
    # kinds[0] is the reference run's, chaos off
    assert kinds[1:] == ["kill_rank"] and "random failures are kill_rank" in capsys.readouterr().out
    spec = load_spec("examples/demo.yaml", ["chaos.mtbf_s=30s"])
    assert with_default_kind(spec, "ray://head:10001", nodes_of=lambda _: 3).chaos.mtbf_kind == "kill_node"
    assert with_default_kind(spec, "ray://head:10001", nodes_of=lambda _: None) is spec  # unreachable: the run says
    given = load_spec("examples/demo.yaml", ["chaos.mtbf_s=30s", "chaos.mtbf_kind=kill_node"])
    assert with_default_kind(given, None).chaos.mtbf_kind == "kill_node"  # asked for: kept (the controller refuses)


def test_the_faulty_run_leaves_a_timeline_png_whose_path_is_printed(tmp_path, capsys):
    class Failing(FakeRunner):  # the chaos run's report holds one injected, recovered failure
        def __call__(self, spec, **kw):
            outcome = super().__call__(spec, **kw)
            failure = FailureRecord(time=3.0, kind="kill_rank", rank=1, detected_after_s=0.1, recovered_after_s=1.0)
            outcome.report.failures.append(failure)
            return outcome

    assert chaos_main(_args(tmp_path), runner=Failing()) == EXIT_OK
    out = capsys.readouterr().out
    assert f"timeline (faults, detections, recoveries) written to {tmp_path / 't.png'}" in out
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_a_given_png_flag_exits_2_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a core install without undying[plot] has
    runner = FakeRunner()
    assert chaos_main(_args(tmp_path), runner=runner) == EXIT_USAGE and runner.names == []
    assert "--timeline:" in capsys.readouterr().err  # named, with the extra: pip install 'undying[plot]'
    sweep = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "30s", "--intervals", "5s",
                                  "--plot", str(tmp_path / "s.png"), "--set", f"checkpoint.url=file://{tmp_path}/c"])
    assert chaos_main(sweep, runner=runner) == EXIT_USAGE and runner.names == []
    assert "--plot: writing" in capsys.readouterr().err
    assert main(["run", "examples/demo.yaml", "--timeline", str(tmp_path / "r.png"),
                 "--set", f"checkpoint.url=file://{tmp_path}/r"]) == EXIT_USAGE
    assert "pip install 'undying[plot]'" in capsys.readouterr().err
    args = _args(tmp_path)
    args.timeline = None  # not asked for: the run goes ahead and says why there is no PNG
    assert chaos_main(args, runner=runner) == EXIT_OK and runner.names == ["unit.reference", "unit"]
    assert "no timeline PNG of this run: matplotlib is not installed" in capsys.readouterr().out


def test_a_tracker_without_its_package_stops_the_experiment_before_its_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    runner = FakeRunner()
    args = _args(tmp_path, "--set", f"monitor.tensorboard={tmp_path}/tb")
    assert chaos_main(args, runner=runner) == EXIT_USAGE and runner.names == []
    assert "monitor.tensorboard: the tensorboard package is not installed" in capsys.readouterr().err


def test_a_parameter_server_spec_is_refused_naming_the_mode(tmp_path, capsys):
    # Its scripted faults would run under the collective controller, which fires no kill_server.
    args = _parser().parse_args(["chaos", "examples/ps.yaml", "--no-reference", "--set", "name=unit",
                                 "--set", f"checkpoint.url=file://{tmp_path}/ckpt",
                                 "--set", "chaos.faults=[{kind: kill_server, server: 0, at_step: 4}]"])
    runner = FakeRunner()
    assert chaos_main(args, runner=runner) == EXIT_USAGE and runner.names == []
    assert "parallel.mode" in capsys.readouterr().err


def test_a_corruption_retention_deleted_before_anything_read_it_or_one_not_applied_tested_nothing(tmp_path):
    from types import SimpleNamespace

    from orchestrator.cli.chaos.experiment import check_faults_fired

    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit",
                                            "chaos.faults=[{kind: corrupt_shard, at_step: 20}]"])
    catalog = catalog_of(spec)
    save_checkpoint(catalog, 30, {"w": torch.ones(2)})  # step 20, corrupted, is gone: keep let retention take it
    fired = FaultRecord(kind="corrupt_shard", fault_id=0, step=20, detail="bit 3 of byte 9 of a shard flipped")

    def check(record):
        return check_faults_fired(spec, SimpleNamespace(faults=[record], faults_skipped=[]), catalog, corrupted={20})

    assert not check(fired).ok and "retention deleted the step before any restore" in check(fired).detail
    save_checkpoint(catalog, 20, {"w": torch.ones(2)})
    assert check(fired).ok  # there, for the verification to read
    refused = fired.model_copy(update={"detail": "could not be applied: OSError: injected"})
    assert not check(refused).ok and "could not be applied" in check(refused).detail


def test_a_fault_whose_notice_died_with_a_killed_controller_counts_as_fired_by_its_marker(tmp_path):
    from types import SimpleNamespace

    from chaos.config import ArmedFault
    from orchestrator.cli.chaos.experiment import check_faults_fired
    from orchestrator.controller.kill import MARKER_DIR, marker_name

    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit",
                                            "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 20}]"])
    catalog = catalog_of(spec)
    nothing = SimpleNamespace(faults=[], faults_skipped=[])  # its notice was in a killed controller's unflushed log
    assert not check_faults_fired(spec, nothing, catalog).ok
    fault = ArmedFault.of(spec.chaos.faults[0], 0)
    catalog.storage.write_immutable(catalog.storage.path(MARKER_DIR, marker_name(fault)), b"{}")
    assert check_faults_fired(spec, nothing, catalog).ok


def test_a_finished_reference_is_reused_only_when_the_releases_that_made_it_are_these(tmp_path, capsys):
    from orchestrator.cli.chaos.experiment import REFERENCE_RECORD, reference_spec

    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"])
    chaos_root, reference = catalog_of(spec).storage, catalog_of(reference_spec(spec)).storage

    def experiment() -> list[str]:
        chaos_root.remove_tree(chaos_root.root)  # the chaos run's own root: each experiment's afresh
        runner = FakeRunner()
        assert chaos_main(_args(tmp_path), runner=runner) == EXIT_OK
        return runner.names

    assert experiment() == ["unit.reference", "unit"]
    assert experiment() == ["unit"]  # reused
    record = json.loads(reference.read(reference.path(REFERENCE_RECORD)))
    reference.remove(reference.path(REFERENCE_RECORD))
    reference.write_immutable(reference.path(REFERENCE_RECORD), json.dumps({**record, "torch": "1.0"}).encode())
    capsys.readouterr()
    assert experiment() == ["unit.reference", "unit"]  # its bits came from another torch: run again
    assert "not reused: it was made with torch '1.0'" in capsys.readouterr().out


def test_the_verdict_names_the_checks_it_skipped(tmp_path, capsys):
    assert chaos_main(_args(tmp_path, "--no-reference"), runner=FakeRunner()) == EXIT_OK
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert "every check passed (1 skipped: model_matches_reference)" in verdict, verdict


def test_a_sweep_that_cannot_measure_says_why_in_one_line(tmp_path, capsys):
    # A calibration too short for a step time, and runs that committed nothing (no save cost): each ends
    # the sweep with its reason and the fix, not a traceback after the runs were spent.
    def runner(spec, *, address, report_path) -> RunOutcome:
        losses = [LossPoint(step=s, loss=1.0, time=10.0 + s) for s in range(spec.train.steps)]
        return RunOutcome(EXIT_OK, RunReport(job=spec.name, final_step=spec.train.steps, status="succeeded",
                                             losses=losses, goodput=GoodputSummary.from_totals({"productive": 5.0})),
                          {}, wall_s=10.0)

    common = ["--mtbf", "120s", "--kind", "kill_rank", "--set", "chaos.faults=[]",
              "--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--fresh"]
    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--intervals", "young", *common,
                                 "--set", "train.steps=1"])
    assert chaos_main(args, runner=runner) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "too few steps to measure a step time; give the job more train.steps, or --step-s" in err
    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--intervals", "young", "--step-s", "0.5",
                                 *common, "--set", "train.steps=40"])
    assert chaos_main(args, runner=runner) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "no committed checkpoint in any report" in err and "Traceback" not in err


def test_a_goodput_snapshot_left_alone_in_an_experiments_root_is_state_fresh_deletes(tmp_path):
    # A run killed before its first commit leaves only its snapshot, whose seconds a fresh start would
    # carry as the job's: a new experiment there is refused without --fresh, like checkpoints.
    from orchestrator.cli.chaos.harness import prepare_root
    from orchestrator.cli.root_lease import CHAOS_MARKER
    from orchestrator.controller.ledger_snapshot import SNAPSHOT_FILE
    from orchestrator.spec.problems import SpecError

    spec = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=unit"])
    storage = catalog_of(spec).storage
    prepare_root(spec, fresh=False)
    storage.write_immutable(storage.path(SNAPSHOT_FILE), b'{"time": 1.0, "totals": {"productive": 5.0}}')
    with pytest.raises(SpecError, match="pass --fresh to delete them"):
        prepare_root(spec, fresh=False)
    prepare_root(spec, fresh=True)
    assert not storage.exists(storage.path(SNAPSHOT_FILE)) and storage.exists(storage.path(CHAOS_MARKER))


def test_a_sweep_refuses_a_later_runs_root_before_any_run(tmp_path, capsys):
    # The 5 s run's root holds an earlier sweep's checkpoints: refused before the calibration and the
    # 2 s run spend their minutes (exit 2 means nothing was started).
    base = ["--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--set", "train.steps=40"]
    args = _parser().parse_args(["chaos", "sweep", "examples/demo.yaml", "--mtbf", "120s", "--kind", "kill_rank",
                                 "--intervals", "2s,5s", "--levels", "storage", *base])
    earlier = load_spec("examples/demo.yaml", [f"checkpoint.url=file://{tmp_path}/ckpt", "name=demo.sweep-5s"])
    save_checkpoint(catalog_of(earlier), 8, {"w": torch.ones(4)})
    runner = FakeRunner()
    assert chaos_main(args, runner=runner) == EXIT_USAGE and runner.names == []
    assert "demo.sweep-5s" in capsys.readouterr().err
