"""A second signal stops a parameter-server driver wherever it is: the Preempted its handler raises
passes through the handlers that turn a failed call into a fallback (here: a worker's stream that
ended with an error, which would have meant a rollback)."""

from __future__ import annotations

import types

import pytest

from paramserver import streams
from paramserver.preemption import Preempted


class _Stream:
    def completed(self):
        return "done-ref"

    def __next__(self):
        return "log-ref"


def test_a_second_signal_inside_a_stream_read_is_not_taken_for_the_stream_s_end(monkeypatch):
    def get(ref):
        raise Preempted("SIGTERM during the grace: stopped at once")  # the handler, mid-call

    monkeypatch.setattr(streams, "ray", types.SimpleNamespace(wait=lambda refs, timeout=0: (refs, []), get=get))
    with pytest.raises(Preempted, match="stopped at once"):
        streams.take(_Stream())


def test_once_the_driver_reports_and_tears_down_a_second_signal_is_recorded_not_raised():
    from paramserver.preemption import Preemption

    preemption = Preemption(25.0)
    preemption.on_signal(15)
    preemption.ending = True  # ps_run: the job returned or stopped; the lease's release must run whole
    preemption.on_signal(2)
    assert preemption.signals == ["SIGTERM", "SIGINT"]


def test_a_second_signal_while_a_finished_job_reads_its_final_stats_is_recorded_not_raised(monkeypatch):
    """Trained to the end, the driver reads the servers' final stats and tears them down: a SIGINT then
    (which stops a job at once during its grace) must not turn the finished job into a preempted one."""
    from paramserver import job
    from paramserver.job_inputs import Checkpoints
    from paramserver.preemption import Preemption
    from tests._ps_fake import DATA, MODEL, PAR, TRAIN

    preemption = Preemption(25.0)
    preemption.on_signal(15)  # the first signal came during the last segment, which ran to the end

    class Finished:  # the supervisor of a job that ran to its last step
        def __init__(self, *args, **kwargs):
            self.servers, self.start_step, self.failures, self.saved, self.redone = [], 0, [], [TRAIN.steps], 0
            self.history = types.SimpleNamespace(poll=lambda servers: preemption.on_signal(2))  # Ctrl-C now
            self.logs = types.SimpleNamespace(losses=list, kept=list, pull_wait=dict)
            self.pids, self.moved = {}, []

        def run(self):
            pass

        def teardown(self):
            pass

    monkeypatch.setattr(job, "Supervisor", Finished)
    checkpoints = Checkpoints("fake://ckpt", 4, job=None, preemption=preemption)
    report = job.run_ps(MODEL, DATA, TRAIN, PAR, checkpoints=checkpoints)
    assert report.checkpoints == [TRAIN.steps] and preemption.signals == ["SIGTERM", "SIGINT"]
