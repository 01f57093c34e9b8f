"""bench.ckpt: the plan and the reductions (fast), and one small end-to-end run (heavy).

The end-to-end run starts 4 gloo ranks and a SeaweedFS server, saves and loads a 16 MiB
state once per system on file:// and s3:// (every load bit-checked by the ranks), runs the
thread-vs-process trials once, and must produce every number of the tables. About a
minute on 2 cores, so it is left out of the default suite: `pytest -m heavy tests/bench`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ckpt.ops import plan
from bench.ckpt.report import reduce_op, summarise, targets

ROOT = Path(__file__).resolve().parents[2]


def test_plan_rotates_systems_and_numbers_our_saves_in_order():
    ops = plan(["file", "s3"], repeats=3, layouts=["dp4", "dp2"])
    steps = [op["step"] for op in ops if "step" in op]
    assert steps == list(range(1, 13))  # two of our saves per repeat and backend, increasing
    firsts = [next(op["op"] for op in ops if op["backend"] == "file" and op["rep"] == rep) for rep in range(3)]
    assert firsts == ["ours_async", "ours_sync", "dcp_save"]
    for backend in ("file", "s3"):
        for rep in range(3):
            mine = [op for op in ops if op["backend"] == backend and op["rep"] == rep]
            assert mine[-1]["op"] == "raw_read"  # last: the repeat's checkpoints are deleted after it
            assert sum(op["op"].endswith("_load") for op in mine) == 4


def _record(op: str, starts: list[float], ends: list[float], **extra) -> dict:
    ranks = [{"start": s, "end": e, **extra} for s, e in zip(starts, ends, strict=True)]
    return {"backend": "file", "rep": 0, "op": op, "ranks": ranks}


def test_reduce_takes_first_start_last_end_and_worst_blocking():
    record = _record("ours_async", [10.0, 10.1], [12.0, 12.0])
    record["ranks"][0]["blocking"], record["ranks"][1]["blocking"] = 0.2, 0.3
    out = reduce_op(record, total_bytes=4 * 10**9)
    assert out["total"] == pytest.approx(2.0) and out["blocking"] == 0.3 and out["gbps"] == pytest.approx(2.0)
    idle = _record("ours_load", [0.0, 0.0], [1.0, 9.0], nbytes=10)
    idle["layout"] = "dp2"
    idle["ranks"][1]["active"] = False  # a rank with nothing to load in the layout does not count
    assert reduce_op(idle, total_bytes=10)["total"] == pytest.approx(1.0)


def test_targets_judge_the_medians():
    result = {"total_bytes": 10**9, "records": [
        {**_record("ours_async", [0.0], [1.0]), "ranks": [{"start": 0.0, "end": 1.0, "blocking": 0.05}]},
        {**_record("ours_sync", [0.0], [1.0]), "ranks": [{"start": 0.0, "end": 1.0, "blocking": 1.0}]},
        {**_record("dcp_save", [0.0], [2.0]), "ranks": [{"start": 0.0, "end": 2.0, "blocking": 2.0}]},
        {**_record("dcp_async", [0.0], [2.0]), "ranks": [{"start": 0.0, "end": 2.0, "blocking": 0.04}]},
    ]}
    verdicts = {what: met for what, _, _, met in targets(summarise(result)["file"], "file", ["dp4"])}
    assert verdicts == {"async blocking / our sync save": True, "async blocking / DCP async_save blocking": False,
                        "save throughput (async) / dcp.save": True, "save throughput (sync) / dcp.save": True}


@pytest.mark.heavy
@pytest.mark.s3
@pytest.mark.timeout(900)
def test_ckpt_bench_small_run_measures_everything(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ckpt", "--size-mib", "16", "--width", "128", "--repeats", "1",
         "--tvp-repeats", "1", "--layouts", "dp4", "dp2", "tp4", "--out", str(out), "--docs", ""],
        cwd=ROOT, capture_output=True, text=True, timeout=850,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["total_bytes"] >= 16 * 2**20
    for record in result["records"]:
        if record["op"].endswith("_load") and record["rep"] == 0:
            checked = [r["checked"] for r in record["ranks"] if r["active"]]
            assert checked and all(n > 0 for n in checked), record  # bit-checked on every loading rank
    for backend in ("file", "s3"):
        ops = result["summary"][backend]
        for name in ("ours_async", "ours_sync", "dcp_save", "dcp_async"):
            assert ops[name]["total"][0] > 0 and ops[name]["blocking"][0] > 0, (backend, name)
        for layout in ("dp4", "dp2", "tp4"):
            assert ops[f"ours_load/{layout}"]["total"][0] > 0 and ops[f"dcp_load/{layout}"]["total"][0] > 0
        assert ops["raw_read"]["read_bytes"][0] > 0
        assert set(result["tvp"][backend]["writers"]) == {"none", "thread", "process"}
    assert "undying / DCP" in proc.stdout and "thread vs process" in proc.stdout
