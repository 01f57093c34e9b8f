"""Parameter-server fault tolerance on a real local Ray (paramserver.supervisor): a killed worker is
replaced with no global restart and a killed server is restored with every other from the last
checkpoint; a stopped (SIGSTOP) worker or server is killed by the hang watchdog and repaired the same
way. In bsp every run ends bit for bit where the failure-free run ends, and the chaos invariants
that apply hold (committed checkpoints verify, the newest loads, the final model equals the
reference, every step applied exactly once in the servers' records, the goodput buckets sum to the
wall, every actor process gone). `undying run` of a ssp job with a kill of each kind and a hang_rank
writes them to its --report. The supervisor's decisions are covered fast in
tests/unit/test_ps_recovery.py, test_ps_supervisor.py and test_ps_hang_watch.py."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest

from ckpt.reader import load_checkpoint
from monitor.goodput import GoodputLedger
from orchestrator.cli.chaos.invariants import (
    check_checkpoints_verify,
    check_goodput,
    check_model_matches,
    check_newest_loads,
    check_no_process_left,
)
from tests.ray.jobs import ROOT, UNDYING
from tests.ray.test_ps import ray_local  # noqa: F401 (the module's private local Ray, a fixture)
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

pytestmark = [pytest.mark.ray, pytest.mark.heavy]

MODEL = ModelConfig(preset="tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2, vocab_size=64, max_seq_len=32)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=12, global_batch=8, micro_batch=2, grad_clip=None, lr=3e-3)
PARALLEL = ParallelConfig(dp=2, mode="ps", servers=2, consistency="bsp")
EVERY = 4  # checkpoint cadence: segments [0, 4), [4, 8), [8, 12)
KILLED_AT = 6


def _run(root: str, faults=(), hang=None):
    from paramserver.checkpoint import PSJob
    from paramserver.job import run_ps
    from paramserver.job_inputs import Checkpoints

    ledger = GoodputLedger()
    checkpoints = Checkpoints(root, EVERY, PSJob("ps-faults", MODEL, DATA, TRAIN, PARALLEL))
    report = run_ps(MODEL, DATA, TRAIN, PARALLEL, max_piece_bytes=2000, checkpoints=checkpoints,
                    faults=list(faults), ledger=ledger, hang=hang)
    return report, ledger


def _final_model(root: str) -> dict:
    from paramserver.checkpoint import catalog

    tensors, _ = load_checkpoint(catalog(root), TRAIN.steps)
    return tensors


def _all_gone(pids: dict) -> None:
    deadline = time.monotonic() + 20  # ray.kill is asynchronous
    while not (check := check_no_process_left(pids)).ok and time.monotonic() < deadline:
        time.sleep(0.5)
    assert check.ok, check.detail


@pytest.fixture(scope="module")
def reference(ray_local, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    root = str(tmp_path_factory.mktemp("ps-reference") / "ckpt")
    report, _ = _run(root)
    assert report.failures == [] and report.checkpoints == [4, 8, 12]
    return report, _final_model(root)


def _one_fault(tmp_path, kind: str, target: int, hang=None):
    """The run with one fault at KILLED_AT: (report, ledger, its one failure, checkpoint root)."""
    from paramserver.recovery import Fault

    root = str(tmp_path / "ckpt")
    report, ledger = _run(root, [Fault(kind, target, KILLED_AT)], hang)
    assert len(report.failures) == 1, [f.line() for f in report.failures]
    return report, ledger, report.failures[0], root


def test_a_killed_worker_is_replaced_while_the_others_go_on(reference, tmp_path):
    expected, expected_model = reference
    report, ledger, failure, root = _one_fault(tmp_path, "worker", 1)
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("worker", 1, "replaced", KILLED_AT)
    assert failure.pause_s is not None and failure.pause_s > 0 and report.redone == 0
    # No global restart: worker 0 and both servers kept their processes; worker 1 changed at the kill.
    assert set(report.pids) == {"server 0", "server 1", "worker 0", "worker 1", "worker 1 #2"}
    pids = {(log.worker, log.step >= KILLED_AT): log.pid for log in report.steps}
    assert pids[(0, False)] == pids[(0, True)] == report.pids["worker 0"]
    assert (pids[(1, False)], pids[(1, True)]) == (report.pids["worker 1"], report.pids["worker 1 #2"])
    assert report.losses == expected.losses  # bsp: bit for bit
    assert check_model_matches(_final_model(root), expected_model).ok
    assert ledger.totals()["reformation"] > 0 and check_goodput(ledger).ok
    _all_gone(report.pids)


def test_a_killed_server_is_restored_with_every_other_from_the_last_checkpoint(reference, tmp_path):
    from paramserver.checkpoint import catalog

    expected, expected_model = reference
    report, ledger, failure, root = _one_fault(tmp_path, "server", 0)
    assert (failure.kind, failure.target, failure.action, failure.from_checkpoint) == ("server", 0, "restored", True)
    assert (failure.resumed_at, failure.steps_redone) == (4, KILLED_AT - 4)
    assert report.losses == expected.losses and report.checkpoints == [4, 8, 12]
    checks = [check_checkpoints_verify(catalog(root)), check_newest_loads(catalog(root)),
              check_model_matches(_final_model(root), expected_model), check_goodput(ledger)]
    assert all(c.ok for c in checks), [c.detail for c in checks if not c.ok]
    # Every step applied exactly once after the rollback, on every server, in the records the driver
    # took (the replaced server's of steps 0..3 before the commit, the undone ones forgotten).
    applied = Counter((r.server, r.worker, r.step) for r in report.records)
    assert applied == Counter({(k, w, s): 1 for k in range(2) for w in range(2) for s in range(TRAIN.steps)})
    totals = ledger.totals()
    assert totals["lost_work"] > 0 and totals["checkpoint_restore"] > 0 and totals["checkpoint_save"] > 0
    _all_gone(report.pids)


HANG_S = 5.0  # the watchdog's limit in the hang tests (a stopped actor neither dies nor answers)


def test_a_stopped_worker_is_killed_by_the_watchdog_and_replaced_while_the_others_wait(reference, tmp_path):
    from paramserver.hang_watch import HangLimits

    expected, expected_model = reference
    report, ledger, failure, root = _one_fault(tmp_path, "worker_hang", 1, HangLimits(floor_s=HANG_S))
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("worker", 1, "replaced", KILLED_AT)
    assert failure.hung.startswith("worker 1 made no step for") and "elastic.hang_timeout_s 5.0 s" in failure.hung
    assert report.redone == 0 and set(report.pids) == {"server 0", "server 1", "worker 0", "worker 1", "worker 1 #2"}
    assert report.losses == expected.losses  # bsp: bit for bit, as after a kill
    assert check_model_matches(_final_model(root), expected_model).ok
    # From the injected stop (its pull of step 6 held, a moment after its last step) to its kill.
    assert ledger.totals()["detection"] >= HANG_S - 1.0 and check_goodput(ledger).ok
    _all_gone(report.pids)


def test_a_stopped_server_is_killed_by_the_watchdog_and_every_server_restored(reference, tmp_path):
    from paramserver.hang_watch import HangLimits

    expected, expected_model = reference
    report, ledger, failure, root = _one_fault(tmp_path, "server_hang", 0, HangLimits(floor_s=HANG_S))
    assert (failure.kind, failure.target, failure.action, failure.resumed_at) == ("server", 0, "restored", 4)
    assert failure.hung.startswith("server 0 did not answer a progress call for")
    assert failure.reason == failure.hung and failure.steps_redone == KILLED_AT - 4
    assert report.losses == expected.losses and report.checkpoints == [4, 8, 12]
    assert check_model_matches(_final_model(root), expected_model).ok
    assert ledger.totals()["detection"] >= HANG_S - 1.0 and check_goodput(ledger).ok
    _all_gone(report.pids)


def test_undying_run_of_a_ps_job_survives_both_kills_and_a_hang_and_reports_them(tmp_path):
    report = tmp_path / "ps.json"
    faults = ("[{kind: kill_rank, rank: 1, at_step: 3}, {kind: hang_rank, rank: 0, at_step: 5}, "
              "{kind: kill_server, server: 1, at_step: 6}]")
    sets = ["train.steps=8", "checkpoint.every_steps=4", f"checkpoint.url=file://{tmp_path}/ckpt",
            f"chaos.faults={faults}", "elastic.hang_timeout_s=5"]
    cmd = [UNDYING, "run", str(ROOT / "examples/ps.yaml"), "--report", str(report)]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    kinds = [(f["kind"], f["action"]) for f in data["failures"]]
    assert kinds == [("worker", "replaced"), ("worker", "replaced"), ("server", "restored")]
    assert data["failures"][1]["hung"].startswith("worker 0 made no step for")  # the spec's limit, through the CLI
    assert "hang 5 s, first step 120 s" in proc.stdout
    assert len(data["losses"]) == 8 and data["checkpoints"] == [4, 8] and data["pauses_s"][0] > 0
    goodput = data["goodput"]  # monitor.report.GoodputSummary, as a collective job's report has it
    buckets = {"productive": goodput["productive_s"], **goodput["badput_s"]}
    assert goodput["ratio"] == pytest.approx(goodput["productive_s"] / goodput["wall_s"])
    assert check_goodput(buckets, wall_s=goodput["clock_wall_s"]).ok
    assert "worker 1 died: replaced" in proc.stdout and "goodput" in proc.stdout
