"""Device clocks: host time on the CPU; on CUDA, events read once recorded work has run (a fake
event stands in for CUDA's here: its record takes a time that the test moves on)."""

from __future__ import annotations

import time

import pytest
import torch

from trainer.data_parallel import SyncClock
from trainer.device_clock import DeviceClock
from trainer.pipeline import ActionEvent, StepTrace


class FakeGpu:
    """torch.cuda.Event's part a DeviceClock uses: `record` stamps the GPU's time, which `now` sets."""

    now = 0.0
    synchronized: list[float] = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = FakeGpu.now

        def synchronize(self):
            FakeGpu.synchronized.append(self.at)

        def elapsed_time(self, end) -> float:
            return (end.at - self.at) * 1000.0


@pytest.fixture
def gpu(monkeypatch):
    FakeGpu.now, FakeGpu.synchronized = 0.0, []
    monkeypatch.setattr(torch.cuda, "Event", FakeGpu.Event)
    return FakeGpu


def test_on_the_cpu_a_mark_is_the_host_clock():
    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.01)
    assert 0.009 <= clock.seconds(start, clock.mark()) < 1.0


def test_on_cuda_seconds_are_the_events_apart_not_the_host_time(gpu):
    clock = DeviceClock(torch.device("cuda"))
    start = clock.mark()
    gpu.now = 2.5  # the GPU ran 2.5 s of work; the host queued it in no time
    end = clock.mark()
    assert clock.seconds(start, end) == pytest.approx(2.5) and gpu.synchronized == [2.5]


def test_ddp_compute_ends_at_the_last_bucket_hand_off_on_the_device(gpu):
    clock = SyncClock(DeviceClock("cuda"))
    clock.start_compute()
    gpu.now = 1.0
    clock.last_ready = clock.device.mark()  # what the communication hook does
    gpu.now = 4.0  # waiting for the slowest rank's all-reduce is not this rank's compute
    assert clock.compute_seconds(ddp=True) == pytest.approx(1.0)
    assert clock.compute_seconds(ddp=False) == pytest.approx(4.0)
    clock.start_compute()  # a new step forgets the last one's hand-off
    assert clock.last_ready is None and clock.compute_seconds(ddp=True) == pytest.approx(0.0)


def test_a_pipeline_trace_settles_onto_the_host_clock_anchored_at_its_window(gpu):
    # Host times, so that the events of the ranks' processes compare (one clock on a machine).
    clock = DeviceClock("cuda")
    opened = clock.mark()
    marks = []
    for t in (1.0, 3.0, 4.0, 8.0):
        gpu.now = t
        marks.append(clock.mark())
    gpu.now = 10.0
    trace = StepTrace(events=[ActionEvent("F", 0, 0, marks[0], marks[1]), ActionEvent("B", 0, 0, marks[2], marks[3])])
    trace.settle(clock, opened, 500.0, clock.mark())  # the window opened at host time 500 s
    assert (trace.window_start, trace.window_end, trace.busy_s) == (500.0, 510.0, 6.0)
    assert [(e.start, e.end) for e in trace.events] == [(501.0, 503.0), (504.0, 508.0)]
    assert trace.idle_fraction() == pytest.approx(0.4) and trace.max_in_flight() == 1
    cpu = DeviceClock("cpu")
    mark, host = cpu.opening()
    assert mark == host and cpu.host_time(mark + 2.0, mark, host) == mark + 2.0  # the host clock itself
