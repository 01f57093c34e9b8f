"""Monitoring on a real run: the goodput ledger after a failure, and straggler detection."""

from __future__ import annotations

import json

import pytest

from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray


def _ledger_after_a_kill(ray_cluster, tmp_path) -> tuple[float, float]:
    """Run a job killed at step 77 (last commit 40); check the ledger; return (lost_work, redone_s)."""
    proc, path = run_job(ray_cluster, tmp_path, "ledger", [
        "train.steps=100", "checkpoint.every_steps=40",
        "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 77}]"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())
    goodput = report["goodput"]
    total = goodput["productive_s"] + sum(goodput["badput_s"].values())
    assert abs(total - goodput["wall_s"]) <= 0.01 * goodput["wall_s"]
    assert goodput["badput_s"]["checkpoint_restore"] > 0 and goodput["badput_s"]["detection"] > 0
    # Steps 40..77 ran twice: the first time is lost work, the second is what it cost.
    assert report["redone_steps"] == 38
    return goodput["badput_s"]["lost_work"], report["redone_s"]


def test_ledger_after_a_kill_adds_up_and_books_the_lost_work(ray_cluster, tmp_path):
    lost, redone = _ledger_after_a_kill(ray_cluster, tmp_path)
    # The two are the same steps computed twice, so they agree as far as step times repeat. On a
    # quiet machine that is within 1% (2.21 s vs 2.20 s); with 4 ranks on 2 cores and other work
    # running, step times drift by tens of percent between the two passes. This bound still
    # catches a ledger that drops the rolled-back steps or books them twice.
    assert 0.5 * redone <= lost <= 1.5 * redone, (lost, redone)


@pytest.mark.heavy
def test_lost_work_matches_the_redone_steps_within_10_percent(ray_cluster, tmp_path):
    """The issue's bound; run it on a quiet machine: `pytest -m heavy -k lost_work`."""
    lost, redone = _ledger_after_a_kill(ray_cluster, tmp_path)
    assert abs(lost - redone) <= 0.10 * redone, (lost, redone)


def test_a_rank_slowed_by_30_percent_is_flagged_within_30_s(ray_cluster, tmp_path):
    proc, path = run_job(ray_cluster, tmp_path, "slow", [
        "train.steps=600", "checkpoint.every_steps=200",
        "chaos.faults=[{kind: slow_rank, rank: 2, at_step: 5, factor: 1.3}]"], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(path.read_text())
    assert [s["rank"] for s in report["stragglers"]] == [2]  # and nobody else, ever
    flagged_after = report["stragglers"][0]["time"] - report["world_history"][0]["started_at"]
    assert flagged_after <= 30.0, flagged_after
    assert "straggler: rank 2" in proc.stdout
