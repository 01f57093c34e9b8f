"""Experiment tracking without processes: the job record's events, the event log under the checkpoint
root, the report rebuilt from it, TensorBoard event files read back with tensorboard's own reader,
and the trackers' failure handling."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ckpt.storage import Storage
from monitor.config import MonitorConfig
from monitor.event_log import EventLog, list_runs, read_run
from monitor.events import Scalars, event, report_from_events
from monitor.goodput import BUCKETS, GoodputLedger
from monitor.metrics import JobMetrics
from monitor.tensorboard_sink import TensorBoardSink
from monitor.tracking import Trackers, tracking_problems
from orchestrator.controller.job_record import JobRecord
from orchestrator.wire.messages import EvalDone, StepDone


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.events, self.flushes, self.closed = [], 0, False

    def emit(self, ev: dict) -> None:
        self.events.append(ev)

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def scripted_run(tracker, nan_at: int | None = None) -> tuple[JobRecord, object]:
    """A run as the controller records it: a layout, 6 steps, a commit at 3, a validation, a failure at
    step 5 rolled back to 3 (steps 3 and 4 computed again, the failure's record filled in as the
    recovery goes), then steps to 8, and the end. Returns the record and its report."""
    clock = Clock()
    ledger = GoodputLedger(clock=clock)
    tracker.emit(event("start", 0, job="tiny", total_steps=8))  # as monitor.tracking.open_trackers does
    record = JobRecord("tiny", 8, JobMetrics("tiny"), ledger, printer=lambda line: None, progress_every_s=0.0,
                       mfu=lambda tokens, step_s: 0.25, tracker=tracker)
    t0 = record.started

    def step(s: int, at: float) -> None:
        clock.now = at
        loss = float("nan") if s == nan_at else 5.0 - 0.1 * s
        record.on_step(StepDone(step=s, loss=loss, tokens=64, step_s=0.5, time=t0 + at, grad_norm=1.5))

    ledger.enter("productive")
    record.on_layout(0, 2, 2, 1, 1)
    for s in range(5):
        step(s, 1.0 + s)
        if s == 2:
            record.on_checkpoint(3, t0 + 3.2, 4096, 0.05, 0.3, None)
            record.on_eval(EvalDone(step=3, loss=4.6, tokens=128, seconds=0.1))
    failure = record.on_failure("rank_died", 1, detected_at=t0 + 6.1, fault_time=t0 + 6.0, message="boom", step=5)
    failure.lost_work_s = record.rolled_back_seconds(3, since=t0, failed_at=t0 + 6.0)
    record.on_restored(failure, "storage", [{"storage_read_bytes": 4096}], 0.4)
    record.on_layout(1, 2, 2, 1, 1)
    record.on_recovered(failure, detected_at=t0 + 6.1)
    for s in range(3, 8):
        step(s, 8.0 + s)
    ledger.stop()
    return record, record.report("succeeded", 8)


def test_the_event_log_rebuilds_the_report_the_record_built(tmp_path):
    storage = Storage(f"file://{tmp_path}/ck/tiny")
    log = EventLog(storage)
    trackers = Trackers([log])
    record, report = scripted_run(trackers, nan_at=1)
    trackers.close()
    assert list_runs(storage) == [log.run]
    events = read_run(storage, log.run)
    rebuilt = report_from_events(events)
    assert math.isnan(rebuilt.losses[1].loss)
    nan_free = lambda r: r.model_copy(update={"losses": [p for p in r.losses if p.step != 1]})  # noqa: E731
    assert nan_free(rebuilt) == nan_free(report)
    assert rebuilt.summary_table() == report.summary_table()
    # steps 3 and 4 computed again, and 5, which the failure interrupted
    assert [p.step for p in rebuilt.losses] == list(range(8)) and rebuilt.redone_steps == 3
    # every line is strict JSON (jq reads it): the NaN loss is the string pydantic reads back
    for name in storage.listdir(log.path):
        for line in (tmp_path / "ck" / "tiny" / "events" / log.run / name).read_text().splitlines():
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_a_fault_is_logged_as_it_fires_so_a_log_without_its_end_still_has_it():
    from orchestrator.wire.messages import FaultFired

    collect = Collect()
    record = JobRecord("tiny", 8, JobMetrics("tiny"), GoodputLedger(), printer=lambda line: None,
                       progress_every_s=0.0, tracker=Trackers([collect], flush_every_s=600.0))
    record.on_fault(FaultFired(fault_id=0, kind="kill_rank", time=record.started + 1.5, rank=1, step=3))
    assert collect.flushes == 1  # flushed at once, not 600 s later: it survives a controller killed right after
    rebuilt = report_from_events([event("start", 0, job="tiny", total_steps=8), *collect.events])
    assert rebuilt.status == "unfinished"
    assert [(f.kind, f.rank, f.step, f.time) for f in rebuilt.faults] == [("kill_rank", 1, 3, pytest.approx(1.5))]


def test_each_flush_is_a_new_segment_and_a_log_without_its_end_rebuilds_as_unfinished(tmp_path):
    storage = Storage("memory://events-unfinished/tiny")
    log = EventLog(storage, run="r1")
    collect = Collect()
    clock = Clock()
    trackers = Trackers([log, collect], flush_every_s=5.0, clock=clock)
    trackers.emit(event("start", 0, job="tiny", total_steps=10))
    ledger = GoodputLedger(clock=clock)
    for s in range(4):
        clock.now = 2.0 * s
        trackers.emit(event("step", s, step=s, loss=1.0, tokens=8, step_s=0.5, time=float(s)))
    clock.now = 7.0
    trackers.emit({**event("goodput", 4, totals=ledger.totals(), ratio=0.0, wall=7.0)})
    log.close()
    segments = storage.listdir(log.path)
    # flushed at t=6 (5 s passed) and at the close: two objects, each written once
    assert segments == ["00000000.jsonl", "00000001.jsonl"] and collect.flushes == 1
    report = report_from_events(read_run(storage, "r1"))
    assert report.status == "unfinished" and report.final_step == 0 and report.job == "tiny"
    assert [p.step for p in report.losses] == [0, 1, 2, 3] and report.goodput.clock_wall_s == 7.0
    with pytest.raises(ValueError, match="no events"):
        report_from_events([])


def test_segments_are_rolled_up_and_read_once_each_whatever_a_crash_left(tmp_path, monkeypatch):
    from monitor import event_log

    monkeypatch.setattr(event_log, "ROLL_UP", 3)
    storage = Storage(f"file://{tmp_path}/ck/tiny")
    log = EventLog(storage, run="r")
    for s in range(8):  # one event per flush: segment s holds step s
        log.emit(event("step", s, step=s, loss=1.0, tokens=8, step_s=0.5, time=float(s)))
        log.flush()
    log.close()
    assert storage.listdir(log.path) == ["00000000-00000002.jsonl", "00000003-00000005.jsonl", "00000006.jsonl",
                                         "00000007.jsonl"]
    assert [e["step"] for e in read_run(storage, "r")] == list(range(8))
    # A writer killed between a roll-up and its deletes leaves covered segments: read once, in the roll-up.
    (tmp_path / "ck" / "tiny" / "events" / "r" / "00000004.jsonl").write_text(
        json.dumps(event("step", 4, step=4, loss=1.0, tokens=8, step_s=0.5, time=4.0)) + "\n")
    assert [e["step"] for e in read_run(storage, "r")] == list(range(8))
    # A reader that listed the segments just before the writer rolled them up and deleted them lists again.
    listings, real = [], storage.listdir
    storage.listdir = lambda path: listings.append(path) or (
        [f"{i:08d}.jsonl" for i in range(8)] if len(listings) == 1 else real(path))
    assert [e["step"] for e in read_run(storage, "r")] == list(range(8)) and len(listings) == 2


def test_a_roll_up_caps_the_bytes_the_writer_holds(tmp_path, monkeypatch):
    from monitor import event_log

    monkeypatch.setattr(event_log, "ROLL_UP_BYTES", 1)  # every segment is over it: rolled up alone
    storage = Storage(f"file://{tmp_path}/ck/tiny")
    log = EventLog(storage, run="r")
    for s in range(2):
        log.emit(event("step", s, step=s, loss=1.0, tokens=8, step_s=0.5, time=float(s)))
        log.flush()
    log.close()
    assert storage.listdir(log.path) == ["00000000-00000000.jsonl", "00000001-00000001.jsonl"]
    assert [e["step"] for e in read_run(storage, "r")] == [0, 1]


def test_a_failing_sink_is_dropped_and_the_others_go_on(caplog):
    class Broken(Collect):
        name = "broken"

        def emit(self, ev: dict) -> None:
            raise OSError("disk full")

    good, broken = Collect(), Broken()
    trackers = Trackers([broken, good])
    for s in range(3):
        trackers.emit(event("step", s, step=s, loss=1.0, tokens=8, step_s=0.5, time=0.0))
    trackers.emit(event("checkpoint", 2, record={"step": 2, "committed_at": 1.0, "bytes": 1, "blocking_s": 0.1,
                                                "total_s": 0.2}))
    trackers.close()
    assert len(good.events) == 4 and good.flushes == 1 and good.closed  # a commit is flushed at once
    assert trackers.sinks == [] and sum("broken failed in emit" in r.message for r in caplog.records) == 1


def test_a_segment_that_cannot_be_written_is_retried_then_dropped(tmp_path, caplog):
    class Flaky:
        url = "flaky://"

        def __init__(self, fails: int) -> None:
            self.fails, self.written = fails, {}

        def path(self, *parts):
            return "/".join(parts)

        def write_immutable(self, path, data):
            if self.fails:
                self.fails -= 1
                raise OSError("503 slow down")
            self.written[path] = data

    flaky = Flaky(fails=2)
    log = EventLog(flaky, run="r", backoff_s=0.0)
    log.emit(event("start", 0, job="j", total_steps=1))
    log.close()
    assert list(flaky.written) == ["events/r/00000000.jsonl"]
    dead = Flaky(fails=100)
    log = EventLog(dead, run="r", backoff_s=0.0)
    log.emit(event("start", 0, job="j", total_steps=1))
    log.close()
    assert dead.written == {} and any("its 1 events are lost" in r.message for r in caplog.records)


def test_tensorboard_has_one_loss_scalar_per_step_and_the_run_events(tmp_path):
    sink = TensorBoardSink(str(tmp_path / "tb"))
    trackers = Trackers([sink])
    record, report = scripted_run(trackers)
    trackers.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    loss = acc.Scalars("train/loss")
    # 8 steps, 2 of them computed again after the rollback: each execution is one point
    assert [e.step for e in loss] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7]
    assert [e.value for e in loss] == pytest.approx([5.0 - 0.1 * s for s in (0, 1, 2, 3, 4, 3, 4, 5, 6, 7)])
    assert {"train/tokens_per_s", "train/mfu", "train/grad_norm", "eval/loss", "goodput/ratio",
            "checkpoint/blocking_s", "world/size", "recovery/failures", "recovery/recovered_after_s",
            "recovery/lost_work_s"} <= tags
    assert {f"goodput/{b}_s" for b in BUCKETS} <= tags
    assert [e.value for e in acc.Scalars("train/mfu")] == [0.25] * 10
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(3, pytest.approx(4.6))]
    assert [e.value for e in acc.Scalars("recovery/failures")] == [1.0]  # sent three times, counted once
    assert len(acc.Scalars("recovery/restore_s")) == 1


def test_tensorboard_to_a_url_is_uploaded_through_the_storage_layer(tmp_path):
    sink = TensorBoardSink("memory://tb-upload/run")
    for s in range(5):
        sink.emit(event("step", s, step=s, loss=float(s), tokens=8, step_s=0.5, time=0.0))
    sink.flush()
    sink.close()
    remote = Storage("memory://tb-upload/run")
    names = remote.listdir(remote.root)
    assert len(names) == 1 and names[0].startswith("events.out.tfevents.")
    (tmp_path / names[0]).write_bytes(remote.read(remote.path(names[0])))
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(s, float(s)) for s in range(5)]
    assert not os.path.exists(sink.local_dir)  # the staging directory is gone


def test_a_long_runs_tensorboard_file_is_rolled_so_a_flush_uploads_only_the_open_one(tmp_path, monkeypatch):
    from monitor import tensorboard_sink

    monkeypatch.setattr(tensorboard_sink, "ROLL_BYTES", 1)  # every flush rolls
    sink = TensorBoardSink("memory://tb-roll/run")
    uploaded = []
    real = sink.remote.atomic_writer
    sink.remote.atomic_writer = lambda path: uploaded.append(path.rsplit("/", 1)[1]) or real(path)
    for flush in range(3):
        for s in range(flush * 2, flush * 2 + 2):
            sink.emit(event("step", s, step=s, loss=float(s), tokens=8, step_s=0.5, time=0.0))
        sink.flush()
        sink._uploads.submit(lambda: None).result()  # the flush's upload is done
        assert len(os.listdir(sink.local_dir)) == 1  # only the open file stays staged
    sink.close()
    remote = Storage("memory://tb-roll/run")
    names = remote.listdir(remote.root)
    assert len(names) == 4  # three rolled at the flushes, and the last one open at the close
    assert all(uploaded.count(name) <= 2 for name in names)  # once open (maybe), once closed: never again
    # Read each file in the order the writers made them (events.out.tfevents.<time>.<host>.<pid>.<uid>,
    # the uid not zero-padded: a directory's name order may differ within one second).
    points = []
    for i, name in enumerate(sorted(names, key=lambda n: (int(n.split(".")[3]), int(n.rsplit(".", 1)[1])))):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / name).write_bytes(remote.read(remote.path(name)))
        acc = EventAccumulator(str(tmp_path / str(i)))
        acc.Reload()
        points += [(e.step, e.value) for e in acc.Scalars("train/loss")] if "train/loss" in acc.Tags()["scalars"] \
            else []
    assert points == [(s, float(s)) for s in range(6)]


def test_scalars_of_a_failure_are_given_once_its_recovery_is_measured():
    scalars = Scalars()
    def failure(index: int = 0, **times) -> dict:
        return event("failure", 5, index=index, record={"time": 1.0, "kind": "rank_died", **times})

    assert scalars.row(failure(detected_after_s=0.1)) == (5, {"recovery/failures": 1.0})
    assert scalars.row(failure(detected_after_s=0.1, recovered_after_s=2.0)) == (5, {})
    x, row = scalars.row(failure(detected_after_s=0.1, recovered_after_s=2.0, first_step_after_s=2.5))
    assert row == {"recovery/detected_after_s": 0.1, "recovery/recovered_after_s": 2.0,
                   "recovery/first_step_after_s": 2.5}
    assert scalars.row(failure(first_step_after_s=2.5)) == (5, {})
    assert scalars.row(failure(index=1)) == (5, {"recovery/failures": 2.0})


def test_a_tracker_whose_package_or_protocol_is_missing_is_a_spec_problem(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard")
                        else real(name, *a))
    cfg = MonitorConfig(tensorboard="nosuchproto://bucket/tb", wandb={"project": "p"})
    problems = dict.fromkeys(f for f, _ in tracking_problems(cfg))
    messages = " ".join(m for _, m in tracking_problems(cfg))
    assert list(problems) == ["monitor.tensorboard", "monitor.wandb"]
    assert "pip install 'undying[wandb]'" in messages and "pip install 'undying[tensorboard]'" in messages
    assert "nosuchproto://" in messages
    assert tracking_problems(MonitorConfig()) == []


def _wandb_records(path):
    """The records of an offline W&B run file: LevelDB's log format (32 KiB blocks, 7-byte record
    headers: crc, length, type full/first/middle/last) after W&B's 7-byte file header."""
    import struct
    from pathlib import Path

    data, pos, partial = Path(path).read_bytes(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = payload if kind in (1, 2) else partial + payload
        if kind in (1, 4):
            yield partial


def test_wandb_offline_gets_every_steps_loss_against_train_step(tmp_path, monkeypatch):
    import glob

    from wandb.proto import wandb_internal_pb2

    from monitor.config import WandbConfig
    from monitor.wandb_sink import WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(WandbConfig(project="undying-test", mode="offline", dir=str(tmp_path)), "tiny",
                     {"parallel": {"dp": 2}})
    trackers = Trackers([sink])
    scripted_run(trackers)
    trackers.close()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = []
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    losses = [(row["train/step"], row["train/loss"]) for row in rows if "train/loss" in row]
    steps = (0, 1, 2, 3, 4, 3, 4, 5, 6, 7)  # a rollback sends 3 and 4 again: logged against train/step
    assert losses == [(s, pytest.approx(5.0 - 0.1 * s)) for s in steps]
    assert [row["eval/loss"] for row in rows if "eval/loss" in row] == [pytest.approx(4.6)]
    assert sum("recovery/failures" in row for row in rows) == 1 and any("goodput/ratio" in row for row in rows)


def test_a_tracker_that_cannot_start_names_its_field_and_the_rest_start_with_the_start_event(tmp_path):
    from monitor.tracking import TrackerUnavailable, open_trackers

    storage = Storage(f"file://{tmp_path}/ck/tiny")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(TrackerUnavailable) as refused:
        open_trackers("tiny", 8, MonitorConfig(tensorboard=str(blocked / "tb")), storage, {}, {})
    assert refused.value.field == "monitor.tensorboard" and "remove monitor.tensorboard" in refused.value.message
    trackers = open_trackers("tiny", 8, MonitorConfig(tensorboard=str(tmp_path / "tb")), storage, {}, {})
    assert trackers.where().startswith(f"event log file://{tmp_path}/ck/tiny/events/")
    assert trackers.where().endswith(f"tensorboard {tmp_path / 'tb'}")
    trackers.close()
    (run,) = list_runs(storage)
    assert [e["kind"] for e in read_run(storage, run)] == ["start"]


def test_a_sink_slow_to_close_keeps_the_driver_no_longer_than_the_grace_left(caplog):
    import threading

    release = threading.Event()

    class SlowToFinish(Collect):
        name = "wandb"

        def close(self) -> None:  # W&B's finish on a slow network
            release.wait(30)
            super().close()

    class Broken(Collect):
        name = "broken"

        def close(self) -> None:
            raise OSError("disk full")

    broken, fast, slow = Broken(), Collect(), SlowToFinish()
    trackers = Trackers([broken, fast, slow])
    started = time.monotonic()
    trackers.close(within_s=0.3)
    assert 0.3 <= time.monotonic() - started < 5 and trackers.sinks == [] and not slow.closed
    assert fast.closed  # after the one that failed to close
    assert any("still closing after 0.3 s" in r.message for r in caplog.records)
    assert any("broken failed in close" in r.message for r in caplog.records)
    release.set()
    sink = Collect()
    Trackers([sink]).close(float("inf"))  # no signal: waited out whole
    assert sink.closed


def test_the_trackers_wait_at_a_run_s_end_is_bounded_by_a_signal_s_grace():
    from types import SimpleNamespace

    from orchestrator.cli.run import _trackers_wait_s
    from orchestrator.cli.teardown import StartUpSignals

    spec = SimpleNamespace(elastic=SimpleNamespace(preemption_grace_s=25.0))
    start_up = StartUpSignals()
    assert _trackers_wait_s(None, start_up, spec) is None  # no signal: the last records are waited for
    start_up.signals.append("SIGTERM")  # one that stopped the set-up, before the controller existed
    assert _trackers_wait_s(None, start_up, spec) == 12.5
    controller = SimpleNamespace(stops=SimpleNamespace(end_wait_s=lambda: 7.0))
    assert _trackers_wait_s(controller, start_up, spec) == 7.0  # the controller's clock of the grace
