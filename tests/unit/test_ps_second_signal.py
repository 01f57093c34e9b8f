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
