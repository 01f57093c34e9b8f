"""Straggler detection and its eviction hook on the local multi-node cluster.

Two runs of the same job: a clean one (nobody may be flagged) and one where chaos slows rank 2
by 30% with `elastic.evict_stragglers` on. The slow rank must be flagged within 30 s, evicted,
replaced by the warm spare (the layout stays dp=4), and the job must end with the clean run's
losses bit for bit: the slowdown only sleeps, and the eviction is a recovery from the last
committed checkpoint like any other.
"""

from __future__ import annotations

import json

import pytest

from tests.ray.jobs import run_job

# Two 300-step runs: minutes on a loaded 2-core machine, more than the default per-test limit.
# Heavy (about 2 minutes): the default suite checks detection and eviction with the controller's fakes
# (tests/unit/test_controller.py); this is the same on real ranks.
pytestmark = [pytest.mark.ray, pytest.mark.heavy, pytest.mark.timeout(1200)]

# Long enough that the slow rank is flagged well before the end on a quiet machine. The
# detector needs 3 heartbeats and then 10 s of sustained slowness: measured 11.2 s after the
# slowdown, at step 113 (~0.1 s per slowed step); on a loaded machine steps are slower and the
# flag comes earlier in steps (step 32 at a load average of 70).
JOB = ["train.steps=300", "checkpoint.every_steps=30", "elastic.spares=1"]
SLOW_RANK = 2


def _report(proc, path) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def clean(ray_cluster, tmp_path_factory):
    """The clean run: (report, stdout)."""
    proc, path = run_job(ray_cluster, tmp_path_factory.mktemp("clean"), "clean",
                         [*JOB, "elastic.evict_stragglers=true", "chaos.faults=[]"], timeout=600)
    return _report(proc, path), proc.stdout


def test_no_rank_is_flagged_in_a_clean_run(clean):
    # Compute time is wall time, so a rank the OS starves of CPU is slow: on this 2-core
    # machine this held in runs at load averages of 20 to 70, and failed in runs at ~70 and
    # ~100 (clean ranks 11-31% slower than their peers for over 10 s).
    report, stdout = clean
    assert report["stragglers"] == [] and "straggler:" not in stdout
    assert report["failures"] == []


def test_a_slow_rank_is_flagged_within_30_s_evicted_and_replaced(ray_cluster, tmp_path, clean):
    proc, path = run_job(ray_cluster, tmp_path, "evict", [
        *JOB, "elastic.evict_stragglers=true",
        f"chaos.faults=[{{kind: slow_rank, rank: {SLOW_RANK}, at_step: 5, factor: 1.3}}]"], timeout=600)
    report = _report(proc, path)
    # The slow rank is flagged first, and once: the spare that took its place runs at full
    # speed. (That no other rank is flagged without a slowdown is the clean run's test: on a
    # machine overloaded ~35-50x, CPU starvation alone has made clean ranks 11-35% slower for
    # over 10 s, and such flags are the clean run's failure, not this one's.)
    flag = report["stragglers"][0]
    assert flag["rank"] == SLOW_RANK and flag["ratio"] > 1.10, report["stragglers"]
    assert [s["rank"] for s in report["stragglers"]].count(SLOW_RANK) == 1, report["stragglers"]
    # Within 30 s of the slowdown, which starts with step 5: at the end of step 4's first
    # execution (a rollback to step 0 would have redone it; `rolled_back` keeps the first).
    step_4_ends = [p["time"] for p in report["losses"] if p["step"] == 4]
    step_4_ends += [r["finished_at"] for r in report["rolled_back"] if r["step"] == 4]
    flagged_after = flag["time"] - min(step_4_ends)
    assert 0.0 < flagged_after <= 30.0, flagged_after
    assert f"straggler: rank {SLOW_RANK} computes {flag['ratio']:.2f}x its peers' median" in proc.stdout
    assert "; evicting it" in proc.stdout
    # The eviction is a recovery of its own kind; the warm spare takes the rank over.
    failure = report["failures"][0]
    assert (failure["kind"], failure["rank"]) == ("straggler_evicted", SLOW_RANK), failure
    assert failure["recovered_after_s"] is not None
    assert [f["kind"] for f in report["failures"]] == ["straggler_evicted"] * len(report["stragglers"])
    assert f"rank(s) [{SLOW_RANK}] taken over by warm spares" in proc.stdout
    assert {w["dp"] for w in report["world_history"]} == {4}
    # Same layout throughout, so the same numbers as the clean run, bit for bit.
    reference, _ = clean
    assert report["final_loss"] == reference["final_loss"]
    assert [(p["step"], p["loss"]) for p in report["losses"]] == \
           [(p["step"], p["loss"]) for p in reference["losses"]]
