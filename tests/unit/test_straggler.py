"""StragglerDetector's rule, and the eviction hook's effect on the chaos fault that made the rank slow."""

from __future__ import annotations

import random

import pytest

from ckpt.storage import Storage
from monitor.straggler import StragglerDetector
from orchestrator.cluster.worker_group import RankOutcome
from orchestrator.wire.store import RendezvousServer
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec


def _feed(detector: StragglerDetector, compute: dict[int, float], beats: int, start: float = 0.0,
          period: float = 0.5, noise: float = 0.0, seed: int = 0) -> tuple[set[int], list[tuple[float, int]]]:
    """`beats` heartbeats per rank every `period` s; returns the final flagged set and (time, rank)
    of each new flag."""
    rng = random.Random(seed)
    flagged, newly_at = set(), []
    for beat in range(beats):
        now = start + beat * period
        for rank, seconds in compute.items():
            detector.observe(rank, seconds * (1.0 + rng.uniform(-noise, noise)))
        flagged, newly = detector.evaluate(now)
        newly_at += [(now, rank) for rank in sorted(newly)]
    return flagged, newly_at


def test_a_rank_30_percent_slower_is_flagged_once_after_the_sustain_window():
    detector = StragglerDetector(threshold=1.10, window=20, sustain_s=10.0)
    flagged, newly_at = _feed(detector, {0: 1.0, 1: 1.0, 2: 1.3, 3: 1.0}, beats=60)
    assert flagged == {2}
    # Three samples per rank before any ratio (t=1.0 s), then 10 s of sustained slowness.
    assert newly_at == [(11.0, 2)]
    assert detector.ratios()[2] == pytest.approx(1.3)


def test_noise_of_plus_minus_8_percent_flags_nobody():
    detector = StragglerDetector()
    flagged, newly_at = _feed(detector, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, beats=200, noise=0.08, seed=3)
    assert flagged == set() and newly_at == []


def test_a_short_slow_spell_is_not_flagged_and_a_recovered_rank_is_unflagged():
    detector = StragglerDetector(window=3, sustain_s=10.0)
    _feed(detector, {0: 1.0, 1: 1.0, 2: 1.5}, beats=10)  # slow for 4 s only
    flagged, newly_at = _feed(detector, {0: 1.0, 1: 1.0, 2: 1.0}, beats=40, start=5.0)
    assert flagged == set() and newly_at == []
    flagged, _ = _feed(detector, {0: 1.0, 1: 1.0, 2: 1.5}, beats=40, start=30.0)
    assert flagged == {2}
    flagged, _ = _feed(detector, {0: 1.0, 1: 1.0, 2: 1.0}, beats=5, start=60.0)
    assert flagged == set()


def test_pipeline_stages_of_unequal_work_are_compared_within_their_stage():
    # tp 1, pp 2, dp 2: ranks 0 and 2 are stage 0 (2 blocks), 1 and 3 stage 1 (2 blocks and the head).
    stage = {0: 1.0, 1: 1.5, 2: 1.0, 3: 1.5}
    everyone = StragglerDetector(sustain_s=0.0)
    assert _feed(everyone, stage, beats=5)[0] == {1, 3}  # the heavier stage, all of it, against the median
    by_stage = StragglerDetector(sustain_s=0.0, peer_group=lambda rank: rank % 2)
    assert _feed(by_stage, stage, beats=5)[0] == set()
    slow_in_stage = StragglerDetector(sustain_s=0.0, peer_group=lambda rank: rank % 2)
    assert _feed(slow_in_stage, {**stage, 3: 1.8}, beats=5)[0] == {3}  # slow for its own stage


def test_reset_forgets_history_for_a_new_generation():
    detector = StragglerDetector(sustain_s=0.0)
    flagged, _ = _feed(detector, {0: 1.0, 1: 2.0, 2: 1.0}, beats=5)
    assert flagged == {1}
    detector.reset()
    assert detector.ratios() == {} and detector.evaluate(100.0) == (set(), set())


class _FaultDrivenWorkers(FakeWorkerGroup):
    """Slowness comes from the armed slow_rank faults each generation is started with, as in a
    real rank's fault injector; an evicted rank's replacement is slow again if they stay armed."""

    def start_training(self, until_step, faults, **kwargs):
        self.slow = {f.rank for f in faults if f.kind == "slow_rank"}
        super().start_training(until_step, faults, **kwargs)


class _PeersReportFirst(_FaultDrivenWorkers):
    """An eviction whose peers' collective errors reach the controller before the killed
    rank's own death, as a Ray actor kill and a gloo connection reset may race."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.killed: int | None = None

    def kill_actor_only(self, rank):
        self.evicted.append(rank)
        self.actors.pop(rank)
        self.killed = rank

    def wait_any(self, timeout_s):
        if self.killed is None:
            return super().wait_any(timeout_s)
        peers = [r for r in sorted(self._running) if r != self.killed]
        if peers:  # first the peers, out of their collective with an error
            self._running = {self.killed}
            return [RankOutcome(r, "aborted", {"error": "collective error"}) for r in peers]
        self._running.clear()
        killed, self.killed = self.killed, None
        return [RankOutcome(killed, "died", {"error": "actor died"})]


@pytest.mark.parametrize("workers_cls", [_FaultDrivenWorkers, _PeersReportFirst], ids=["death-first", "peers-first"])
def test_eviction_disarms_the_slow_rank_fault_so_the_replacement_runs_at_full_speed(tmp_path, workers_cls):
    rendezvous = RendezvousServer("127.0.0.1")
    spec = _spec(tmp_path, train={"steps": 60, "global_batch": 4, "micro_batch": 1},
                 elastic={"evict_stragglers": True, "max_restarts": 3, "spares": 1}, monitor={"heartbeat_s": 0.001},
                 chaos={"faults": [{"kind": "slow_rank", "rank": 1, "at_step": 0, "factor": 1.3}]})
    workers = workers_cls(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    ctl = _controller(spec, workers, rendezvous, lines)
    ctl.telemetry.detector.sustain_s = 0.0  # the fake trains in milliseconds
    report = ctl.run()
    assert report.status == "succeeded", report.error
    assert workers.evicted == [1] and [s.rank for s in report.stragglers] == [1]
    assert [(f.kind, f.rank) for f in report.failures] == [("straggler_evicted", 1)]
    assert ctl.fault_clock.armed() == []


def test_the_controller_compares_each_rank_with_its_pipeline_stage(tmp_path):
    from monitor.metrics import JobMetrics
    from orchestrator.controller.telemetry import Telemetry

    spec = _spec(tmp_path, model={"preset": "tiny", "n_layers": 4}, parallel={"dp": 2, "tp": 2, "pp": 2})
    telemetry = Telemetry(spec, JobMetrics("pp"), heartbeat_s=0.5)
    telemetry.on_layout(spec, 2)
    # rank = (dp * pp + pp_index) * tp + tp_index: stage 0 holds ranks 0, 1, 4, 5.
    assert [telemetry.detector.peer_group(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
