"""Smoke test of bench.recovery: one repeat of every system, numbers present and positive.

Heavy (a few minutes on 2 cores: Ray start, four training runs with a kill, one without),
so it is left out of the default suite; run it with `pytest -m heavy tests/bench`. Needs the
`bench` extra (`pip install -e '.[bench]'`) for Ray Train.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_recovery_bench_measures_every_system(tmp_path):
    for module in ("pandas", "pyarrow"):
        pytest.importorskip(module, reason="Ray Train needs the bench extra: pip install -e '.[bench]'")
    out = tmp_path / "recovery.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.recovery", "--repeats", "1", "--out", str(out),
         "--work", str(tmp_path / "work"), "--docs", ""],
        cwd=ROOT, capture_output=True, text=True, timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())

    assert set(result["summary"]) == {"undying", "undying (warm spare)", "undying (shrink)", "undying (two-level)",
                                      "Ray Train", "torchrun"}
    two_level = result["summary"]["undying (two-level)"]
    assert two_level["restore_levels"] == ["memory"] and two_level["storage_read_bytes"]["max"] == 0, two_level
    assert two_level["steps_redone"]["max"] <= two_level["memory_every"], two_level
    for name, summary in result["summary"].items():
        for key in ("detection_s", "kill_to_first_step_s", "wall_s"):
            assert summary[key]["median"] > 0, (name, key, summary[key])
        assert summary["steps_redone"]["median"] >= 1, name
        assert summary["detection_s"]["median"] < summary["kill_to_first_step_s"]["median"], name
        assert summary["loss_matches_reference"] is True, (name, summary["final_losses"], result["reference"])
    assert "undying" in result["table"] and "Ray Train" in result["table"] and "torchrun" in result["table"]
