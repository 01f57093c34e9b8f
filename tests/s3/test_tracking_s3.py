"""Tracking on the real S3 server: the event log is written as one object per flush and `undying report`
rebuilds the run from it; a TensorBoard URL is uploaded through the storage layer and reads back."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ckpt.storage import Storage
from monitor.event_log import EventLog, list_runs
from monitor.events import event
from monitor.tensorboard_sink import TensorBoardSink
from monitor.tracking import Trackers
from orchestrator.cli.main import main
from tests.unit.test_tracking import scripted_run

pytestmark = pytest.mark.s3


def test_event_log_and_report_over_s3(capsys, s3_backend, tmp_path):
    storage = Storage(s3_backend.url, s3_backend.storage_options)
    log = EventLog(storage)
    trackers = Trackers([log])
    _, report = scripted_run(trackers)
    trackers.close()
    assert list_runs(storage) == [log.run]
    segments = storage.listdir(log.path)
    assert segments and all(name.endswith(".jsonl") for name in segments)
    assert main(["report", s3_backend.url, "--json", "--timeline", str(tmp_path / "t.png"),
                 *s3_backend.cli_options()]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["report"] == json.loads(report.model_dump_json()) and (tmp_path / "t.png").exists()


def test_tensorboard_to_s3_reads_back(s3_backend, tmp_path):
    url = s3_backend.url.rsplit("/", 1)[0] + "/tb"
    sink = TensorBoardSink(url, s3_backend.storage_options)
    for s in range(20):
        sink.emit(event("step", s, step=s, loss=1.0 / (s + 1), tokens=8, step_s=0.5, time=0.0))
        if s == 9:
            sink.flush()  # an upload mid-run, replaced whole by the later ones
    sink.close()
    remote = Storage(url, s3_backend.storage_options)
    [name] = remote.listdir(remote.root)
    (tmp_path / name).write_bytes(remote.read(remote.path(name)))
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(20))
