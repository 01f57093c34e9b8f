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


def test_the_kills_are_seeded_steps_both_systems_fire_at_the_same_point_of_training(tmp_path):
    import argparse
    import os

    from bench.goodput.main import job_overrides
    from bench.goodput.worker import kill_hook
    from orchestrator.spec.job_spec import load_spec

    args = argparse.Namespace(seed=2, first=50, kills=3, mean_steps=150.0, steps=1000, every=20, overrides=[])
    kills = kill_schedule(args, 4)
    assert len(kills) == 3 and kill_schedule(args, 4) == kills  # seeded: the same every time
    assert [s for s, _ in kills] == sorted(s for s, _ in kills) and all(50 < s < 1000 and 0 <= r < 4 for s, r in kills)
    # undying: kill_rank faults at those steps, after the backward.
    spec = load_spec("examples/demo.yaml", job_overrides(args, kills))
    assert [(f.kind, f.at_step, f.rank, f.at_point) for f in spec.chaos.faults] == [
        ("kill_rank", s, r, "after_backward") for s, r in kills]
    # Ray Train: the hook of the rank a kill names fires at that step's after_backward, once per job.
    step, rank = kills[0]
    fired = []
    cfg = {"kills": kills, "markers": str(tmp_path), "events": str(tmp_path / "events.jsonl")}
    os.makedirs(cfg["markers"], exist_ok=True)
    import bench.goodput.worker as worker

    real_kill, worker.os.kill = worker.os.kill, lambda pid, sig: fired.append((pid, sig))
    try:
        hook = kill_hook(cfg, rank)
        hook("after_forward", step)
        hook("after_backward", step - 1)
        assert fired == []
        hook("after_backward", step)
        hook("after_backward", step)  # the replayed step after the restart: spared
        assert len(fired) == 1
        assert kill_hook(cfg, next(r for r in range(4) if r not in {r for _, r in kills})) is None
    finally:
        worker.os.kill = real_kill
