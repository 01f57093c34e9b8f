"""bench.engine.bubble: the reductions and the table (fast); its measurement runs in
tests/dist/test_pipeline.py, and the benchmark itself with `python -m bench.engine.bubble`."""

from __future__ import annotations

import argparse

import pytest

from bench.engine.bubble import formula, parse_case, rows_of, table


def _rank(idle_per_step: list[float], in_flight: int) -> list[tuple]:
    return [(idle, in_flight, []) for idle in idle_per_step]


def test_rows_take_the_median_of_the_ranks_mean_and_drop_the_first_step():
    # p=2, m=4: formula 1/5. Step 0 (set-up) is left out; step 2 is an outlier the median drops.
    ranks = [{"gpipe": _rank([0.9, 0.20, 0.60, 0.22], 4), "1f1b": _rank([0.9, 0.30, 0.30, 0.30], 2)},
             {"gpipe": _rank([0.9, 0.22, 0.60, 0.20], 4), "1f1b": _rank([0.9, 0.30, 0.30, 0.30], 1)}]
    gpipe, one_f = rows_of((2, 4, 1024), ranks)
    assert formula(2, 4) == pytest.approx(0.2)
    assert gpipe["measured"] == pytest.approx(0.21) and gpipe["ok"] and gpipe["in_flight"] == 4
    assert one_f["ratio"] == pytest.approx(1.5) and not one_f["ok"] and one_f["in_flight_bound"] == 2
    text = table([gpipe, one_f])
    assert "| p2 m4 d1024 | gpipe | 21.0% | 20.0% | 1.05 | yes | 4 (4) |" in text
    assert "| p2 m4 d1024 | 1f1b | 30.0% | 20.0% | 1.50 | NO | 2 (2) |" in text


@pytest.mark.parametrize("text", ["2x8", "1x8x512", "2x8x30", "axbxc"])
def test_a_malformed_case_is_refused_with_its_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="PxMxD|P >= 2"):
        parse_case(text)
