"""bench.goodput's accounting of a Ray Train run, from events written by hand (no Ray)."""

from __future__ import annotations

import pytest

from bench.goodput.main import kill_schedule, raytrain_numbers


def test_surviving_steps_lost_time_and_redone_steps():
    step = lambda t, s, loss=1.0: {"ev": "step", "t": t, "step": s, "step_s": 0.5, "loss": loss}  # noqa: E731
    events = [
        {"ev": "fit_start", "t": 100.0, "t0": 100.0}, {"ev": "restored", "t": 105.0, "step": 0},
        step(106, 0), step(107, 1), step(108, 2),  # checkpoint after step 1 (next_step 2), then step 2 is lost
        {"ev": "kill", "t": 108.4, "kill": 0, "step": 3},
        {"ev": "restored", "t": 118.0, "step": 2}, step(119.4, 2), step(120, 3, loss=0.25),
        {"ev": "fit_end", "t": 121.0},
    ]
    got = raytrain_numbers(events)
    assert got["wall_s"] == 21.0 and got["failures"] == 1 and got["steps_redone"] == 1
    assert got["productive_s"] == 2.0  # steps 0..3 once each, 0.5 s each
    assert got["lost_per_failure_s"] == pytest.approx(11.0 + 0.5)  # kill -> first step after restore, + redone
    assert got["goodput"] == pytest.approx(2.0 / 21.0) and got["final_loss"] == 0.25


def test_kill_schedule_is_the_controllers():
    from orchestrator.spec.job_spec import load_spec

    spec = load_spec("examples/demo.yaml", ["chaos.faults=[]", "chaos.mtbf_s=60s", "chaos.mtbf_kind=kill_rank",
                                            "chaos.seed=2", "chaos.mtbf_start_s=25s", "chaos.mtbf_max_faults=3"])
    kills = kill_schedule(spec)
    assert len(kills) == 3 and [t for t, _ in kills] == sorted(t for t, _ in kills)
    assert all(t >= 25.0 for t, _ in kills) and all(0 <= r < 4 for _, r in kills)
    assert kill_schedule(spec) == kills  # seeded: the same every time
