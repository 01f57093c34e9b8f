"""A rank blocked on a checkpoint save keeps beating (orchestrator.rank.beats), and the controller's
hang watchdog counts it as busy while its bytes move (orchestrator.controller.save_watch): a long
save is no hang, a save that writes nothing for the stall limit is, and so is a rank whose beats stop."""

from __future__ import annotations

import pytest

from orchestrator.controller.save_watch import SAVE_STALL_FLOOR_S, SaveWatch, stall_s
from orchestrator.rank.beats import Beats
from orchestrator.wire.messages import Heartbeat


class KeyStore:
    def __init__(self):
        self.values: dict[str, dict] = {}

    def set_json(self, key: str, value: dict) -> None:
        self.values[key] = value


def test_a_rank_beats_after_steps_and_while_blocked_on_its_save(monkeypatch):
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("orchestrator.rank.beats.time.monotonic", lambda: next(clock))
    store, written = KeyStore(), [0]
    beats = Beats(store, 3, heartbeat_s=2.0, saved_bytes=lambda: written[0])
    beats.while_blocked()
    assert store.values == {}  # no step yet: nothing to repeat
    beats.after_step(0, 0.5)  # t=0: due
    beats.after_step(1, 0.7)  # t=1: not due
    beats.after_step(2, 0.9)  # t=2: due, the mean of the two steps since
    beat = Heartbeat.from_json(store.values["hb/3"])
    assert (beat.step, beat.compute_s, beat.saving) == (2, pytest.approx(0.8), None)
    beats.while_blocked()
    assert Heartbeat.from_json(store.values["hb/3"]).saving is None  # nothing saved yet: not blocked on one
    beats.saving(3)
    written[0] = 4096
    beats.while_blocked()
    blocked = Heartbeat.from_json(store.values["hb/3"])
    assert (blocked.step, blocked.compute_s, blocked.saving, blocked.saved_bytes) == (2, pytest.approx(0.8), 3, 4096)
    assert blocked.time >= beat.time


def _beat(time: float, saving: int | None = None, saved: int = 0) -> Heartbeat:
    return Heartbeat(step=9, time=time, compute_s=0.1, saving=saving, saved_bytes=saved)


def test_a_save_that_writes_is_busy_one_that_stops_writing_stalls_and_silent_ranks_are_no_excuse():
    watch, limit = SaveWatch(), 10.0
    watch.observe(0, _beat(1.0), now=0.0)
    watch.observe(1, _beat(1.0), now=0.0)
    assert not watch.busy(limit, now=20.0) and watch.stalled(limit, now=20.0) is None  # training ranks: a hang
    # Rank 1 blocks on the save of step 10 and keeps beating; its bytes move until t=30.
    for t, saved in [(5.0, 100), (15.0, 200), (25.0, 300), (30.0, 300)]:
        watch.observe(1, _beat(t, saving=10, saved=saved), now=t)
    assert watch.busy(limit, now=31.0)  # a long save, beating and writing: no hang
    # It keeps beating but writes nothing: busy until the stall limit, then stalled.
    for t in range(35, 160, 5):
        watch.observe(1, _beat(float(t), saving=10, saved=300), now=float(t))
    assert watch.busy(limit, now=25.0 + stall_s(limit) - 1)
    assert not watch.busy(limit, now=25.0 + stall_s(limit) + 1)
    why = watch.stalled(limit, now=25.0 + stall_s(limit) + 1)
    assert "rank(s) [1] blocked on the save of step(s) [10] wrote nothing" in why
    # A saver whose beats stopped (SIGSTOP) is no excuse once its last beat is older than the limit.
    watch.observe(1, _beat(200.0, saving=10, saved=400), now=200.0)
    assert watch.busy(limit, now=209.0) and not watch.busy(limit, now=211.0)
    assert watch.stalled(limit, now=211.0) is None
    watch.reset()
    assert not watch.busy(limit, now=0.0)


def test_a_save_s_stall_counts_from_its_start_not_from_the_save_before():
    watch, limit = SaveWatch(), 10.0
    watch.observe(1, _beat(1.0, saving=10, saved=300), now=1.0)  # the save of step 10 wrote its bytes
    watch.observe(1, _beat(2.0, saved=300), now=2.0)  # then the rank trained for 500 s
    for t in range(5, 500, 5):
        watch.observe(1, _beat(float(t), saved=300), now=float(t))
    for t in range(500, 625, 5):  # blocked on step 20's save from t=500, beating, no byte written yet
        watch.observe(1, _beat(float(t), saving=20, saved=300), now=float(t))
    # Busy within the stall limit of the save's own start (not stalled since the old bytes at t=1).
    assert watch.busy(limit, now=500.0 + stall_s(limit) - 1)
    assert not watch.busy(limit, now=500.0 + stall_s(limit) + 1)


def test_the_stall_limit_is_the_floor_or_the_hang_limit():
    assert stall_s(10.0) == SAVE_STALL_FLOOR_S and stall_s(600.0) == 600.0


def test_telemetry_feeds_the_save_watch_and_keeps_blocked_beats_from_the_straggler_detector():
    from types import SimpleNamespace

    from orchestrator.controller.telemetry import Telemetry

    class Store:
        def __init__(self):
            self.beats = {}

        def get_many_json(self, keys):
            return [self.beats.get(k) for k in keys]

    telemetry = Telemetry.__new__(Telemetry)
    telemetry.heartbeat_s, telemetry._last_poll, telemetry._seen, telemetry._unparsed = 0.0, 0.0, {}, set()
    observed = []
    telemetry.detector = SimpleNamespace(observe=lambda rank, s: observed.append(rank),
                                         evaluate=lambda now: ([], set()), last_ratios={})
    telemetry.metrics = SimpleNamespace(on_rank_compute=lambda rank, s: None,
                                        on_stragglers=lambda flagged, ratios=None: None)
    telemetry.saves = SaveWatch()
    store = Store()
    store.beats["hb/0"] = _beat(1.0).to_json()
    store.beats["hb/1"] = _beat(1.0, saving=10, saved=5).to_json()
    telemetry.poll(store, 2)
    assert observed == [0]  # rank 1's beat repeats a step's compute time while it waits on a save
    assert telemetry.saves.busy(10.0)
