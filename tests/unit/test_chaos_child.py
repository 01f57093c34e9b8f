"""`undying chaos` with kill_controller, without Ray: the child runs are faked, the rerun rule is real.

A child that dies by SIGKILL after recording a kill_controller fault as fired is run again; any
other end (success, failure, a SIGKILL nobody recorded) is final; PIDs and wall of every run add up."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

import monitor.report
import orchestrator.cli.chaos.child as chaos_child
from chaos.config import ArmedFault
from monitor.event_log import EventLog
from monitor.events import event, record_event
from monitor.report import FailureRecord, FaultRecord
from orchestrator.cli.chaos.experiment import catalog_of
from orchestrator.controller.kill import MARKER_DIR, marker_name
from tests.unit.test_controller import _spec


def _report(**fields) -> monitor.report.RunReport:
    return monitor.report.RunReport(job="unit", final_step=30, status="succeeded",
                                    goodput=monitor.report.GoodputSummary.from_totals({}), **fields)


class FakeChildren:
    """Stands in for `subprocess.run` of the child: each call plays the next scripted end."""

    def __init__(self, spec, ends: list[str]):
        self.spec, self.ends, self.calls = spec, list(ends), []
        self.specs, self.files = [], []  # each child's stdin, and the files of the run's directory

    def __call__(self, cmd, input=None, **kwargs):
        report_path, pids_path = cmd[3:5]
        self.calls.append(cmd)
        self.specs.append(input)
        self.files.append({path.name: path.read_text() for path in Path(pids_path).parent.iterdir()})
        attempt = len(self.calls) - 1
        with open(pids_path, "w") as handle:
            json.dump({"pids": {"actor a pid": 100 + attempt}, "starts": {"actor a pid": "1"}}, handle)
        end = self.ends[attempt]
        if end == "killed":  # what ControllerKill does before its SIGKILL, and the run's event log so far
            storage = catalog_of(self.spec).storage
            fault = ArmedFault.of(self.spec.chaos.faults[0], 0)
            marker = {"kind": "kill_controller", "point": "after_manifest_commit", "step": 10, "job_s": 4.5}
            storage.create_exclusive(storage.path(MARKER_DIR, marker_name(fault)), json.dumps(marker).encode())
            log = EventLog(storage, run=f"run-{attempt}")
            log.emit(event("start", 0, job="unit", total_steps=30))
            log.emit(record_event("fault", 5, FaultRecord(time=2.0, kind="kill_rank", rank=1, step=5)))
            log.emit(record_event("failure", 5, FailureRecord(time=2.1, kind="rank_died", rank=1, step=5), index=0))
            log.close()
        if end in ("killed", "sigkill"):
            return subprocess.CompletedProcess(cmd, -signal.SIGKILL)
        with open(report_path, "w") as handle:
            handle.write("{}")
        return subprocess.CompletedProcess(cmd, 0 if end == "ok" else 1)


@pytest.fixture
def spec(tmp_path):
    return _spec(tmp_path, chaos={"faults": [{"kind": "kill_controller", "at_point": "after_manifest_commit"}]})


@pytest.mark.parametrize(("ends", "runs", "code"), [
    (["killed", "ok"], 2, 0),  # killed by the fault, rerun, finished
    (["killed", "failed"], 2, 1),
    (["sigkill"], 1, 1),  # killed, but not by the fault: not rerun
    (["ok"], 1, 0),
])
def test_reruns_only_after_a_recorded_kill(monkeypatch, tmp_path, spec, ends, runs, code):
    children = FakeChildren(spec, ends)
    monkeypatch.setattr(chaos_child.subprocess, "run", children)
    monkeypatch.setattr(monitor.report.RunReport, "from_json", classmethod(lambda cls, path: _report()))
    outcome = chaos_child.run_rerunning(spec, address="1.2.3.4:6379", report_path=str(tmp_path / "r.json"))
    assert len(children.calls) == runs and outcome.code == code
    assert all(c[-2:] == ["--address", "1.2.3.4:6379"] for c in children.calls)
    assert outcome.pids == {f"run {i} actor a pid": 100 + i for i in range(runs)}
    assert (outcome.report is not None) == (ends[runs - 1] in ("ok", "failed"))


def test_at_most_one_rerun_per_kill_controller_fault(monkeypatch, tmp_path, spec):
    """A rerun that dies by SIGKILL with the fault's marker already there (from the first run) was not
    killed by the fault, which fires once per job: that end is final."""
    children = FakeChildren(spec, ["killed", "killed", "ok"])
    monkeypatch.setattr(chaos_child.subprocess, "run", children)
    outcome = chaos_child.run_rerunning(spec, address=None, report_path=str(tmp_path / "r.json"))
    assert len(children.calls) == 2 and outcome.code == 1 and outcome.report is None


def test_the_spec_reaches_the_child_through_a_pipe_never_a_file(monkeypatch, tmp_path):
    """Its storage options may hold credentials (read from a storage_options_file)."""
    secret = "wJalrXUtnFEMI-not-a-real-key"
    spec = _spec(tmp_path, chaos={"faults": [{"kind": "kill_controller", "at_point": "after_manifest_commit"}]},
                 checkpoint={"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2,
                             "storage_options": {"secret": secret}})
    children = FakeChildren(spec, ["killed", "ok"])
    monkeypatch.setattr(chaos_child.subprocess, "run", children)
    monkeypatch.setattr(monitor.report.RunReport, "from_json", classmethod(lambda cls, path: _report()))
    chaos_child.run_rerunning(spec, address=None, report_path=str(tmp_path / "r.json"))
    assert len(children.specs) == 2 and all(json.loads(s)["checkpoint"]["storage_options"] == {"secret": secret}
                                            for s in children.specs)
    assert not any(secret in text for files in children.files for text in files.values())
    assert not any(secret in part for cmd in children.calls for part in cmd)


def test_the_report_joins_the_faults_and_failures_of_the_killed_attempts(monkeypatch, tmp_path, spec):
    # The killed attempt logged a kill_rank and its failure before the kill_controller fault killed it;
    # the rerun's own report has a later fault. Before, only the rerun's were in the outcome.
    children = FakeChildren(spec, ["killed", "ok"])
    monkeypatch.setattr(chaos_child.subprocess, "run", children)
    last = _report(faults=[FaultRecord(time=9.0, kind="kill_rank", rank=0, step=25)])
    monkeypatch.setattr(monitor.report.RunReport, "from_json", classmethod(lambda cls, path: last))
    outcome = chaos_child.run_rerunning(spec, address=None, report_path=str(tmp_path / "r.json"))
    assert [(f.kind, f.rank, f.step, f.time, f.point) for f in outcome.report.faults] == [
        ("kill_rank", 1, 5, 2.0, None), ("kill_controller", None, 10, 4.5, "after_manifest_commit"),
        ("kill_rank", 0, 25, 9.0, None)]
    assert [(f.kind, f.rank) for f in outcome.report.failures] == [("rank_died", 1)]


def test_a_store_failing_for_a_moment_neither_ends_the_experiment_nor_skips_the_rerun(monkeypatch, tmp_path, spec):
    # Whether the child died from the fault is read from its marker: a read that fails transiently is
    # retried (checkpoint.read_retry_s), not a traceback that ends `undying chaos` mid-experiment.
    import orchestrator.cli.chaos.experiment as experiment
    from ckpt.catalog import Catalog
    from ckpt.storage import Storage

    class Flapping(Storage):
        failures = 4  # the first calls meet a reset connection

        def _flap(self) -> None:
            self.failures -= 1
            if self.failures >= 0:
                raise ConnectionResetError("connection reset by peer")

        def exists(self, path):
            self._flap()
            return super().exists(path)

        def listdir(self, path):
            self._flap()
            return super().listdir(path)

    flapping = Flapping(spec.checkpoint_root)
    monkeypatch.setattr(experiment, "catalog_of", lambda s: Catalog(flapping))
    children = FakeChildren(spec, ["killed", "ok"])
    monkeypatch.setattr(chaos_child.subprocess, "run", children)
    monkeypatch.setattr(monitor.report.RunReport, "from_json", classmethod(lambda cls, path: _report()))
    outcome = chaos_child.run_rerunning(spec, address=None, report_path=str(tmp_path / "r.json"))
    assert len(children.calls) == 2 and outcome.code == 0 and flapping.failures < 0
