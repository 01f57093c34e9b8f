"""bench.engine: layout parsing and the table (fast), and one small end-to-end run on gloo ranks (heavy).

The end-to-end run launches a world-1 and a world-2 group of processes; on a shared 2-core machine that
takes about a minute, so it is left out of the default suite: `pytest -m heavy tests/bench/test_engine_bench.py`.
"""

from __future__ import annotations

import json

import pytest

from bench.engine.main import (
    COLUMNS,
    REFERENCE,
    default_layouts,
    label,
    main,
    parse_layout,
    parse_model,
    table,
    world_of,
)


def test_layouts_parse_and_default_to_four_processes():
    assert parse_layout("dp2tp2z1") == {"dp": 2, "tp": 2, "pp": 1, "zero": 1, "schedule": "1f1b"}
    assert parse_layout("dp1pp2:gpipe") == {"dp": 1, "tp": 1, "pp": 2, "zero": 0, "schedule": "gpipe"}
    assert label(parse_layout("dp1")) == REFERENCE
    layouts = default_layouts(4)
    assert max(world_of(x) for x in layouts) == 4 and any(x["pp"] == 2 for x in layouts)
    assert {x["zero"] for x in layouts if x["dp"] == 1} == {0}  # zero is not applied at dp = 1
    assert any(world_of(x) == 8 for x in default_layouts(8))
    assert parse_model("tiny,n_layers=2") == {"preset": "tiny", "n_layers": 2}


def test_table_keeps_a_refused_layout_as_a_row():
    rows = [{"layout": REFERENCE, "world": 1, "step_s": 0.1, "vs_ref": 1.0, "tokens_per_s": 100.0, "bubble": None,
             "max_loss_diff": 0.0, "mfu": 0.5},
            {"layout": "dp1tp1pp2z0:pipedream", "world": 2, "error": "ValueError: no | pipes"}]
    lines = table(rows, "MFU").splitlines()
    assert all(line.count("|") == len(COLUMNS) + 1 for line in lines)
    assert "refused or failed: ValueError: no / pipes" in lines[3]


@pytest.mark.heavy
def test_two_tiny_layouts_match_the_reference(tmp_path):
    out, docs = tmp_path / "engine.json", tmp_path / "benchmarks.md"
    argv = ["--layouts", "dp2tp1z0", "dp1tp2z0", "--steps", "2", "--warmup", "1", "--model", "tiny",
            "--seq-len", "32", "--global-batch", "4", "--json", str(out), "--docs", str(docs)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    header = result["table"].splitlines()[0]
    for column in COLUMNS[:-1]:
        assert f"| {column} |" in header
    assert "MFU (CPU, vs measured matmul peak)" in header
    rows = {row["layout"]: row for row in result["rows"]}
    assert set(rows) == {REFERENCE, "dp2tp1pp1z0", "dp1tp2pp1z0"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["max_loss_diff"] == pytest.approx(0.0, abs=1e-4)
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    text = docs.read_text()
    assert "## Engine step time by parallel layout" in text and result["command"] in text
    assert "<!-- engine-notes:" in text and "load average" in text
