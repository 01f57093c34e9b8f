"""bench.ps end to end in its --quick form (heavy): collective dp2 on gloo ranks and bsp / ssp / asp
parameter-server jobs on the embedded local Ray, with a straggler, 8 steps each, about a minute on
2 cores: `pytest -m heavy tests/bench/test_ps_bench.py`. The pure parts are tests/unit/test_bench_ps.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ps.main import NOTES, SECTION

pytestmark = [pytest.mark.heavy, pytest.mark.ray]


def test_quick_run_measures_every_mode_and_writes_its_section(tmp_path):
    out, docs, plot = tmp_path / "ps.json", tmp_path / "benchmarks.md", tmp_path / "ps.png"
    # Its own process, as `python -m bench.ps` runs: an embedded Ray started and stopped inside the
    # test process before the ray tests' multi-node cluster starts leaves that cluster's actors unable to run.
    run = subprocess.run([sys.executable, "-m", "bench.ps", "--quick", "--json", str(out), "--docs", str(docs),
                          "--plot", str(plot)], capture_output=True, text=True, timeout=900,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == {"collective dp", "ps bsp", "ps ssp s=3", "ps asp"}
    for row in rows.values():
        assert row["straggler"] and row["wall_s"] > 0 and math.isfinite(row["final_loss"])
        assert row["final_loss"] < math.log(2048)  # trained: below the uniform guess
    # bsp reaches its own final loss (by its last step: the smoothed curve may touch it before);
    # its updates are never stale; bsp equals collective dp numerically.
    assert 0 < rows["ps bsp"]["to_target_s"] <= rows["ps bsp"]["wall_s"]
    assert rows["ps bsp"]["staleness_max"] == 0
    assert rows["ps bsp"]["final_loss"] == pytest.approx(rows["collective dp"]["final_loss"], abs=1e-4)
    # Dense bsp moves 2DS, to the byte.
    assert "| ps bsp (dense), all servers |" in result["bytes_table"]
    assert result["bytes_table"].splitlines()[2].endswith("| 1.000 |")
    assert plot.stat().st_size > 10_000
    text = docs.read_text()
    assert SECTION in text and NOTES[0] in text and NOTES[1] in text and "![loss against wall time](ps.png)" in text
