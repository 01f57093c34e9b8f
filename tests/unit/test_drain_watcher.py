"""The driver's view of Ray's drain table (orchestrator.cluster.drain), with a fake GCS answer."""

from __future__ import annotations

from orchestrator.cluster.drain import DrainWatcher


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_asks_the_gcs_at_most_every_poll_and_converts_deadlines():
    answers = [{"n1": 0, "n2": 1_700_000_000_500}, {}]
    calls = []

    def source():
        calls.append(1)
        return answers[len(calls) - 1]

    clock = Clock()
    watcher = DrainWatcher(poll_s=1.0, source=source, clock=clock)
    assert watcher.draining() == {"n1": None, "n2": 1_700_000_000.5}  # 0 ms: no deadline
    clock.now = 0.5
    assert watcher.draining() == {"n1": None, "n2": 1_700_000_000.5} and len(calls) == 1
    clock.now = 1.0
    assert watcher.draining() == {} and len(calls) == 2  # the drain was cancelled


def test_a_failing_gcs_keeps_the_last_answer(caplog):
    state = {"fail": False}

    def source():
        if state["fail"]:
            raise ConnectionError("GCS unavailable")
        return {"n1": 0}

    clock = Clock()
    watcher = DrainWatcher(poll_s=1.0, source=source, clock=clock)
    assert watcher.draining() == {"n1": None}
    state["fail"] = True
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        assert watcher.draining() == {"n1": None}
    assert sum("could not read Ray's draining nodes" in r.message for r in caplog.records) == 1
