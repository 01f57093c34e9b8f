"""`undying chaos` end to end on the multi-node test cluster: random rank kills, then the invariant table.

The soak test is `heavy` (left out of the default suite). Run it with, e.g.:

    .venv/bin/python -m pytest -m heavy tests/ray/test_chaos_cmd.py -k soak -s              # ~110 minutes
    UNDYING_SOAK_S=300 .venv/bin/python -m pytest -m heavy tests/ray/test_chaos_cmd.py -k soak -s

`undying chaos` first runs the failure-free reference (same steps), then the faulty run, so
the whole test takes two to four times UNDYING_SOAK_S.

The soak job is 3D-parallel on 4 ranks: dp 2 x pp 2 (1F1B) with ZeRO-1, so every recovery restores
sharded optimizer state into a pipeline. UNDYING_SOAK_S sizes the job (train.steps =
UNDYING_SOAK_S / UNDYING_SOAK_STEP_S, the wall seconds per step of the faulty run, failures
included: 0.09 by default, so 20000 steps, the soak's length in docs/benchmarks.md; measured on a
2-core machine with storage checkpoints only, 20000 steps took 2079 s with 30 failures, and at
today's defaults (a warm spare, the memory level) 3902 s with 61 failures); UNDYING_SOAK_MTBF is
chaos.mtbf_s per rank (default 240s: the 4-rank job sees a failure every 60 s on average, a job
MTBF of 60 s) and UNDYING_SOAK_SEED its seed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from chaos.durations import parse_duration
from tests._tokens import write_token_dataset
from tests.ray.jobs import assert_every_check_passed, chaos_job

pytestmark = pytest.mark.ray



# Random kills through `undying chaos` also run in the README test and the soak (both heavy); the default
# suite keeps the scripted chaos runs below.
@pytest.mark.heavy
def test_random_rank_kills_pass_every_invariant(ray_cluster, tmp_path):
    # Two random kills, due 15.5 and 16.6 s into the job (a kill due during start-up fires as soon as the
    # ranks train); 200 steps keep the job training well past that on a loaded machine.
    proc, report_path = chaos_job(ray_cluster, tmp_path, "random-kills", [
        "--mtbf", "8s", "--kind", "kill_rank", "--seed", "3", "--start", "12s", "--max-faults", "2"],
        ["train.steps=200", "checkpoint.every_steps=20"], timeout=420)
    report = assert_every_check_passed(proc, report_path)
    assert "reference run 'random-kills.reference' (chaos off) first" in proc.stdout
    kinds = [f["kind"] for f in report["failures"]]
    assert 1 <= len(kinds) <= 2 and set(kinds) == {"kill_rank"}, report["failures"]
    assert report["faults_skipped"] == []  # each kill that fired was known to (its notice came)
    assert report["experiment"]["chaos"]["mtbf_kind"] == "kill_rank"
    assert len(report["experiment"]["rank_pids"]) >= 5  # 4 ranks and at least one replacement


def test_prepared_data_kill_and_shrink_every_window_once_from_the_ranks_reports(ray_cluster, tmp_path):
    """A prepared dataset at dp 4, rank 1 killed at step 25 with no replacement in time: dp shrinks
    to 2 from the step-20 checkpoint. The exactly-once check compares the window digests the ranks
    reported at each commit with the data schedule; a validation loss is taken every 20 steps."""
    tokens = np.random.default_rng(0).integers(0, 256, size=40_000)
    write_token_dataset(tmp_path / "train", tokens, vocab_size=256, shard_tokens=7_000)
    write_token_dataset(tmp_path / "val", tokens[::-1].copy(), vocab_size=256, shard_tokens=7_000)
    proc, report_path = chaos_job(ray_cluster, tmp_path, "tokens", [], [
        "data.source=tokens", f"data.path=file://{tmp_path}/train", "data.seq_len=32",
        f"eval={{path: 'file://{tmp_path}/val', every_steps: 20, windows: 8}}",
        "elastic.replace_timeout_s=0", "elastic.grow=false",
        "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 25}]"], timeout=420)
    report = assert_every_check_passed(proc, report_path)
    assert "shrinking dp 4 -> 2" in proc.stdout, proc.stdout[-4000:]
    once = next(c for c in report["invariants"]["checks"] if c["name"] == "data_exactly_once")
    assert "as the ranks reported them" in once["detail"] and "dp sizes [2, 4]" in once["detail"], once
    assert [e["step"] for e in report["evals"]] == [20, 40] and all(e["tokens"] == 8 * 32 for e in report["evals"])
    assert "eval after step 40: validation loss" in proc.stdout


@pytest.mark.timeout(900)  # three runs of the job: the reference, the killed one, the rerun
def test_kill_controller_before_a_manifest_commit_passes_every_invariant(ray_cluster, tmp_path):
    """The controller SIGKILLs itself with every shard of step 20 durable and its manifest not yet
    written; `undying chaos` reruns it, the rerun resumes from step 10 (step 20's leftovers are an
    unfinished save), the fault does not fire again, and the dead controller's ranks are gone."""
    proc, report_path = chaos_job(ray_cluster, tmp_path, "killctl", [], [
        "chaos.faults=[{kind: kill_controller, at_point: before_manifest_commit, at_step: 20}]"], timeout=840)
    report = assert_every_check_passed(proc, report_path)
    out = proc.stdout
    assert out.count("chaos: kill_controller at before_manifest_commit of step 20") == 1, out[-6000:]
    assert "the controller died from kill_controller (SIGKILL); running the job again (rerun 1)" in out
    assert "restored step 10" in out
    # The ranks of both controllers were recorded; the check above found none of them alive.
    assert sum(label.startswith("run 0 ") for label in report["experiment"]["rank_pids"]) >= 1
    assert sum(label.startswith("run 1 ") for label in report["experiment"]["rank_pids"]) >= 1
    assert [c["step"] for c in report["checkpoints"]] == [20, 30, 40]
    # The killed run wrote no report: its kill joins the rerun's from the marker it left.
    assert [(f["kind"], f["step"], f["point"]) for f in report["faults"]] == [
        ("kill_controller", 20, "before_manifest_commit")]


@pytest.mark.heavy
def test_soak_poisson_rank_kills(ray_cluster, tmp_path):
    duration = float(os.environ.get("UNDYING_SOAK_S", "1800"))
    steps = max(100, int(duration / float(os.environ.get("UNDYING_SOAK_STEP_S", "0.09"))))
    rank_mtbf = os.environ.get("UNDYING_SOAK_MTBF", "240s")
    flags = ["--mtbf", rank_mtbf, "--kind", "kill_rank",
             "--seed", os.environ.get("UNDYING_SOAK_SEED", "1"), "--start", "10s"]
    # The job's defaults, which BASE pins off for the other tests: the memory level at Young's interval
    # and a warm spare that refills itself; storage every 25 steps, and the job's MTBF (4 ranks) as the
    # prior, as a user who knows the failure rate would set them.
    sets = [f"train.steps={steps}", "checkpoint.every_steps=25", "elastic.max_restarts=100000", "elastic.spares=auto",
            "checkpoint.memory.enabled=true", f"checkpoint.mtbf_s={parse_duration(rank_mtbf) / 4}",
            "parallel.dp=2", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=1"]
    proc, report_path = chaos_job(ray_cluster, tmp_path, "soak", flags, sets, timeout=4 * duration + 900)
    report = assert_every_check_passed(proc, report_path)
    assert report["failures"], "the soak saw no failure: raise UNDYING_SOAK_S or lower UNDYING_SOAK_MTBF"
    print(f"soak: {steps} steps, {len(report['failures'])} failures, goodput {report['goodput']['ratio']:.1%}, "
          f"wall {report['goodput']['wall_s']:.0f} s")


test_soak_poisson_rank_kills = pytest.mark.timeout(4 * float(os.environ.get("UNDYING_SOAK_S", "1800")) + 1200)(
    test_soak_poisson_rank_kills)
