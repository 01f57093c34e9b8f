"""What the benchmarks' summaries claim follows from what they measured: no winner is called
from an unmeasured noise floor, and the goodput bench heads with the like-for-like figures."""

from bench.ckpt.report import tvp_verdict
from bench.goodput.main import margin


def _tvp(none_trials: list[float]) -> dict:
    return {"s3": {"window_s": 8.1, "baseline_step_s": 0.0025, "writers": {
        "none": {"trials": [{"lost": x} for x in none_trials], "median_lost": 0.0, "median_write": 0.0},
        "thread": {"trials": [], "median_lost": 1.36, "median_write": 3.9},
        "process": {"trials": [], "median_lost": 0.52, "median_write": 4.1}}}}


def test_a_writer_is_called_the_winner_only_past_a_measured_noise_floor():
    # One trial of no writer is its own baseline: its lost time is 0 by construction, not a floor.
    assert "no winner is called" in tvp_verdict(_tvp([0.0]))
    assert "the process writer costs training 0.840 s less" in tvp_verdict(_tvp([0.1, -0.05, 0.0]))
    assert "within the noise floor" in tvp_verdict(_tvp([0.9, -0.2, 0.0]))


def test_the_goodput_bench_heads_with_the_wall_of_the_same_steps_and_kills():
    ours = {"system": "undying", "wall_s": 121.1, "failures": 3, "lost_per_failure_s": 6.34, "steps_redone": 39,
            "final_loss": 1.0, "goodput": 0.737}
    anchor = {**ours, "system": "Ray Train", "wall_s": 159.0, "lost_per_failure_s": 16.46, "steps_redone": 36,
              "goodput": 0.498}
    line = margin([ours, anchor])
    assert line.startswith("- the same 3 kills and steps: wall 121.1 s vs 159.0 s (1.31x)")
    assert "steps redone 39 vs 36" in line and "(not one measure)" in line and "points" not in line
