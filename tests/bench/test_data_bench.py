"""bench.data: the table's reductions over rounds (fast), and one small end-to-end run (heavy).

The end-to-end run makes a 2 MiB corpus, runs the loop and `undying data prepare` (embedded
Ray, and a standing local cluster) twice each, and the loader on file://; it must produce
every number of the table with equal token streams. About a minute on 2 cores, so it is
left out of the default suite: `pytest -m heavy tests/bench/test_data_bench.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.data.main import table
from bench.data.prepare import medians

ROOT = Path(__file__).resolve().parents[2]


def _result(rounds: list[dict]) -> dict:
    prepare = {"corpus_mib": 2.0, "tokens": 1_000_000, "documents": 100, "batch_s": 5.0, "fast_s": 4.0,
               **medians(rounds), "rounds": rounds, "same_stream": True}
    return {"prepare": prepare, "loader": {}}


def test_table_reports_medians_and_the_rounds_own_ratios():
    rounds = [{"loop_s": 10.0, "ours_s": 5.0, "ours_after_startup_s": 4.0, "ours_cluster_s": 4.0},
              {"loop_s": 12.0, "ours_s": 8.0, "ours_after_startup_s": 6.0, "ours_cluster_s": 6.0},
              {"loop_s": 11.0, "ours_s": 5.5, "ours_after_startup_s": 5.0, "ours_cluster_s": 5.0}]
    text = table(_result(rounds))
    # medians: loop 11.0, ours 5.5 -> 2.00x; the rounds' own ratios 2.00, 1.50, 2.00
    assert "| `undying data prepare`, Ray Data, end to end, median of 3 | 5.5 | 181,818 | **2.00x (1.50-2.00x)** |" \
        in text
    assert "| one-process `tokenizers` loop (anchor), median of 3 | 11.0 |" in text
    assert "| one process, `encode_batch`, once | 5.0 | 200,000 | 2.20x |" in text


@pytest.mark.heavy
def test_a_small_run_produces_every_number(tmp_path):
    out = tmp_path / "data.json"
    subprocess.run([sys.executable, "-m", "bench.data", "--mib", "2", "--rounds", "2", "--backends", "file",
                    "--loader-tokens", "2000000", "--json", str(out), "--docs", ""],
                   cwd=ROOT, check=True, timeout=900)
    result = json.loads(out.read_text())
    prepare = result["prepare"]
    assert prepare["same_stream"] is True and len(prepare["rounds"]) == 2
    for key in ("loop_s", "ours_s", "ours_after_startup_s", "ours_cluster_s", "batch_s", "fast_s"):
        assert prepare[key] > 0, key
    assert result["loader"]["file"]["wait_fraction"] >= 0
