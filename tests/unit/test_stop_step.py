"""Where a stop lands and how long it may take (orchestrator.controller.stopping.Stops), with fakes:
the controller's record, its event intake and the drain table, on a fixed clock."""

from __future__ import annotations

import time
from types import SimpleNamespace

from orchestrator.controller.states import TrainingRun
from orchestrator.controller.stopping import Stops, stop_lead

NOW = 1000.0


def _stops(drains: dict, completed: int, stepped: bool = True, save_s: float = 15.0, steps: int = 10_000) -> Stops:
    record = SimpleNamespace(completed_steps=lambda: completed, median_step_s=lambda: 1.0, evals=[],
                             checkpoints=[SimpleNamespace(total_s=save_s)], generation_stepped=stepped)
    spec = SimpleNamespace(train=SimpleNamespace(steps=steps), eval=None,
                           elastic=SimpleNamespace(preemption_grace_s=25.0))
    intake = SimpleNamespace(drain=lambda store: [], step_at=NOW)  # the newest step event: just now
    workers = SimpleNamespace(node_of=lambda rank: "n2" if rank == 1 else "n1")
    return Stops(spec, workers, SimpleNamespace(), record, None, None, intake, lambda: drains, print,
                 clock=lambda: NOW)


def test_a_drain_stop_that_fits_its_deadline_may_take_all_of_it_to_commit():
    # 28 s left: the stop step a few steps ahead (1 s each) and its save (15 s) fit. The commit may
    # come up to the deadline: cut 15 s short, the stop would have been taken for a lost node at 13 s.
    stops = _stops({"n2": time.time() + 28.0}, completed=500)
    phase = stops._stop(TrainingRun(), None, world_size=2, restored=None)
    assert phase is not None and phase.node == "n2" and phase.step == 500 + stop_lead(1.0)
    assert 27.0 < phase.deadline - NOW <= 28.0
    too_short = _stops({"n2": time.time() + 10.0}, completed=500)  # needs ~18 s: a node loss at once
    lost = []
    too_short._lost = lambda node, why: lost.append((node, why))
    assert too_short._stop(TrainingRun(), None, world_size=2, restored=None) is None
    assert lost and lost[0][0] == "n2" and "a checkpointed stop needs" in lost[0][1]


def test_before_a_generation_s_first_step_the_ranks_are_at_the_restored_step():
    # Rolled back from 1095 to 1000: until the new generation reports a step, the newest event is the
    # old one's; counted from there the stop would lie ~100 steps beyond the ranks and miss its deadline.
    stops = _stops({}, completed=1095, stepped=False)
    assert stops._stop_step(None, restored=1000) == (1000, 1000, 1000 + stop_lead(1.0))
    stepped = _stops({}, completed=1003, stepped=True)
    assert stepped._stop_step(None, restored=1000)[0] == 1003
    fresh = _stops({}, completed=40, stepped=False)  # a fresh start after a rollback to nothing
    assert fresh._stop_step(None, restored=None)[0] == 0


def test_no_grow_once_the_job_s_last_step_is_done():
    # The final save is on: stopping the generation to grow would abandon it and redo the last steps.
    stops = _stops({}, completed=60, steps=60)
    stops.recovery = SimpleNamespace(grow_to=lambda dp, world: (4, 2))
    assert stops.grow_at(None, gen=3, dp=2, world_size=2, since=0.0) is None
