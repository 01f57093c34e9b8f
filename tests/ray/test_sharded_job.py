"""A tensor-parallel, ZeRO-3 job on the multi-node test cluster: dp=2 x tp=2 (4 ranks).

Without a replacement for a killed rank, dp shrinks to 1: the dp=2 checkpoint is resharded
into the dp=1 x tp=2 layout on load, and the losses stay within 1e-5 of the failure-free run
(heavy tier).
A killed rank that is replaced resumes bit for bit: a dp=2 x pp=2 job here, against its own
failure-free run; the sharded layout in the heavy tier (the engine's own resume test,
tests/dist/test_engine_parallel.py, covers it in the default suite).
"""

from __future__ import annotations

import json

import pytest

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from orchestrator.cli.chaos.invariants import check_model_matches
from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray
# Shorter than the DDP tests' job: tensor parallelism on shared CPU cores is several times slower.
LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3", "train.steps=20", "checkpoint.every_steps=5",
          "train.micro_batch=4"]


@pytest.fixture(scope="module")
def sharded_reference(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded-ref")
    proc, report = run_job(ray_cluster, tmp, "shref", [*LAYOUT, "chaos.faults=[]"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "each TP group on one node, 2 TP group(s) over 2 node(s)" in proc.stdout  # a node has 2 slots
    return json.loads(report.read_text())


def _ok(proc, path) -> dict:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(path.read_text())


# Heavy (about 50 s on two cores): tests/s3/test_ckpt_round_trip.py loads a dp2 x tp2 x pp2 ZeRO-3 save
# into four-rank layouts bit exact, and tests/ray/test_node_loss.py shrinks a job at a lost node.
@pytest.mark.heavy
def test_shrink_reshards_the_checkpoint_into_the_smaller_layout(ray_cluster, tmp_path, sharded_reference):
    assert [(w["dp"], w["tp"], w["world_size"]) for w in sharded_reference["world_history"]] == [(2, 2, 4)]
    proc, path = run_job(ray_cluster, tmp_path, "shshrink", [
        *LAYOUT, "elastic.replace_timeout_s=0", "elastic.grow=false",
        "chaos.faults=[{kind: kill_rank, rank: 2, at_step: 7}]"])
    report = _ok(proc, path)
    assert "shrinking dp 2 -> 1" in proc.stdout and "restored step 5" in proc.stdout, proc.stdout[-3000:]
    assert [(w["dp"], w["world_size"]) for w in report["world_history"]] == [(2, 4), (1, 2)]
    for ours, ref in zip(report["losses"], sharded_reference["losses"], strict=True):
        assert ours["step"] == ref["step"] and ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)


@pytest.mark.heavy
def test_killed_rank_of_a_sharded_layout_resumes_bit_exact(ray_cluster, tmp_path, sharded_reference):
    proc, path = run_job(ray_cluster, tmp_path, "shkill",
                         [*LAYOUT, "elastic.spares=1", "chaos.faults=[{kind: kill_rank, rank: 3, at_step: 12}]"])
    report = _ok(proc, path)
    assert [f["kind"] for f in report["failures"]] == ["kill_rank"]
    assert report["final_loss"] == sharded_reference["final_loss"]


def test_pipeline_job_recovers_bit_exact_and_agrees_with_the_sharded_layout(ray_cluster, tmp_path,
                                                                            sharded_reference):
    # dp=2 x pp=2 (1F1B): a killed rank of the second stage is taken over by a warm spare; the run
    # equals the same layout's failure-free run bit for bit (losses, final model and optimizer
    # state), and the dp=2 x tp=2 ZeRO-3 run to rounding (same data, same initial weights).
    layout = [item for item in LAYOUT if not item.startswith(("parallel.tp", "parallel.zero"))]
    pipe = [*layout, "parallel.pp=2", "parallel.schedule=1f1b", "elastic.spares=1"]
    reference = _ok(*run_job(ray_cluster, tmp_path, "piperef", [*pipe, "chaos.faults=[]"]))
    proc, path = run_job(ray_cluster, tmp_path, "pipe",
                         [*pipe, "chaos.faults=[{kind: kill_rank, rank: 3, at_step: 7}]"])
    report = _ok(proc, path)
    assert [(p["step"], p["loss"]) for p in report["losses"]] == [(p["step"], p["loss"]) for p in reference["losses"]]
    final = [load_checkpoint(Catalog(Storage(f"file://{tmp_path}/ckpt/{name}")), 20)[0]
             for name in ("pipe", "piperef")]
    check = check_model_matches(*final, exact=True)
    assert check.ok and any(name.startswith("optim/") for name in final[0]), check.detail
    assert [(w["dp"], w["pp"]) for w in report["world_history"]] == [(2, 2), (2, 2)]
    assert [f["kind"] for f in report["failures"]] == ["kill_rank"]
    # Rank 2 (stage 0 of replica 1) errors out first; rank 0 waits for it in the stage-0 dp group, a
    # sub-group of the mesh: the abort must reach that group's sockets, or rank 0 hangs and is killed.
    assert report["failures"][0]["killed_at_release"] == []
    assert report["final_loss"] == pytest.approx(sharded_reference["final_loss"], rel=1e-4)
