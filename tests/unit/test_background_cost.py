"""A save's background cost: the time it took from the steps it overlapped, for Young's interval."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from orchestrator.controller.background_cost import BackgroundCost


@dataclass
class Step:
    step_s: float


def steps(times: dict[int, float]) -> dict[int, Step]:
    return {s: Step(t) for s, t in times.items()}


def test_steps_a_background_write_slowed_are_charged_above_the_clean_median():
    cost = BackgroundCost()
    # Steps 0-9 clean at 0.10 s; step 10 saved (its blocking is charged apart); 11-13 ran at 0.13 s
    # while the write went on.
    times = {s: 0.10 for s in range(10)} | {10: 0.5} | {s: 0.13 for s in range(11, 14)}
    assert cost.charge(10, steps(times), 13) == pytest.approx(3 * 0.03)
    # The next save's baseline leaves the overlapped steps and the saved step out.
    times |= {s: 0.10 for s in range(14, 20)} | {20: 0.5, 21: 0.12}
    assert cost.charge(20, steps(times), 21) == pytest.approx(0.02)


def test_no_charge_until_enough_clean_steps_say_what_a_step_costs():
    cost = BackgroundCost()
    assert cost.charge(2, steps({0: 0.1, 1: 0.1, 2: 0.4, 3: 0.3, 4: 0.3}), 4) == 0.0
    assert cost.charge(0, {}, -1) == 0.0


def test_a_write_that_slows_nothing_costs_nothing_and_faster_steps_are_not_a_credit():
    cost = BackgroundCost()
    times = {s: 0.1 for s in range(10)} | {10: 0.3, 11: 0.1, 12: 0.08}
    assert cost.charge(10, steps(times), 12) == 0.0


def test_a_restore_forgets_the_marks_of_the_steps_it_will_run_again():
    cost = BackgroundCost()
    times = {s: 0.1 for s in range(10)} | {10: 0.3, 11: 0.2, 12: 0.2}
    cost.charge(10, steps(times), 12)
    cost.on_restored(10)
    assert 11 not in cost.overlapped and 10 in cost.overlapped
    cost.on_restored(None)
    assert not cost.overlapped


def test_after_a_rollback_only_the_running_generation_s_steps_are_charged():
    """Generation 0 reached step 19 (its steps 11-19 slow); generation 1 restored step 10, saved
    it again at step 12 and has run 13 and 14: the save overlapped 13 and 14 only. The records of
    15-19 are generation 0's, work already booked as lost."""
    cost = BackgroundCost()
    times = {s: 0.1 for s in range(10)} | {10: 0.3} | {s: 0.5 for s in range(11, 20)}
    cost.charge(10, steps(times), 19)
    cost.on_restored(10)
    times |= {11: 0.1, 12: 0.3, 13: 0.15, 14: 0.15}
    assert cost.charge(12, steps(times), 14) == pytest.approx(2 * 0.05)
    assert 15 not in cost.overlapped


def test_the_baseline_is_the_newest_clean_steps_whatever_the_job_s_age():
    """Walking back from the newest step gives the median a sort of every step gave, with saves,
    gaps (a rollback's missing steps) and more clean steps than the window."""
    import random
    import statistics

    from orchestrator.controller.background_cost import BASELINE_WINDOW

    rng = random.Random(0)
    cost, times = BackgroundCost(), {}
    for step in range(3000):
        if rng.random() < 0.02:
            continue  # never reported
        times[step] = rng.uniform(0.08, 0.12)
        if step % 25 == 0 and step:
            cost.charge(step, steps(times), step)
            clean = [times[s] for s in sorted(times) if s not in cost.overlapped][-BASELINE_WINDOW:]
            newest = cost._newest_clean(steps(times), max(times))
            assert len(newest) == len(clean) and statistics.median(newest) == statistics.median(clean)


def test_a_job_whose_saves_overlap_every_step_costs_the_same_at_any_age():
    """With every step overlapped the baseline walk stops at LOOKBACK_STEPS, and `overlapped`
    forgets what it cannot reach: both stay bounded however long the job runs."""
    from orchestrator.controller.background_cost import LOOKBACK_STEPS

    visited = []

    class Watched(dict):
        def __contains__(self, step):
            visited.append(step)
            return super().__contains__(step)

    cost, records = BackgroundCost(), Watched()
    for saved in range(0, 3 * LOOKBACK_STEPS, 4):  # a save every 4 steps, each overlapping the next 3
        records.update(steps({s: 0.1 for s in range(saved, saved + 4)}))
        visited.clear()
        assert cost.charge(saved, records, saved + 3) == 0.0  # never 5 clean steps: no baseline
        assert len(cost.overlapped) <= 2 * LOOKBACK_STEPS + 4
        assert len(visited) <= LOOKBACK_STEPS + 4
