"""bench.engine.bubble: the reductions and the table (fast); its measurement runs in
tests/dist/test_pipeline.py, and the benchmark itself with `python -m bench.engine.bubble`."""

from __future__ import annotations

import argparse

import pytest

from bench.engine.bubble import formula, instant_transfer_bubble, parse_case, rows_of, table
from trainer.pipeline import ActionEvent


def _rank(rank: int, idle_per_step: list[float], in_flight: int) -> list[tuple]:
    """One rank's (idle, in flight, events) per step; every step's events a balanced GPipe step's."""
    return [(idle, in_flight, _gpipe(2, 4, [1.0, 1.0], [2.0, 2.0])[rank]) for idle in idle_per_step]


def _gpipe(p: int, m: int, forward: list[float], backward: list[float], transfer: float = 0.0) -> list[list]:
    """Each rank's ActionEvents of one GPipe step (all forwards, then all backwards, in microbatch
    order) with per-stage action times and a fixed delay for every message between stages."""
    events: list[list] = [[] for _ in range(p)]
    end_f: dict = {}
    for s in range(p):
        t = 0.0
        for i in range(m):
            t = max(t, end_f[s - 1, i] + transfer if s else 0.0)
            events[s].append(ActionEvent("F", s, i, t, t + forward[s]))
            t = end_f[s, i] = t + forward[s]
    end_b: dict = {}
    for s in reversed(range(p)):
        t = end_f[s, m - 1]
        for i in range(m):
            t = max(t, end_b[s + 1, i] + transfer if s < p - 1 else 0.0)
            events[s].append(ActionEvent("B", s, i, t, t + backward[s]))
            t = end_b[s, i] = t + backward[s]
    return events


def test_the_instant_transfer_replay_is_the_formula_for_equal_stages_and_more_for_unequal_ones():
    # Equal stages: the formula exactly, however slow the transfers were when the trace was taken.
    for p, m in ((2, 4), (2, 8), (4, 8)):
        assert instant_transfer_bubble(_gpipe(p, m, [1.0] * p, [2.0] * p, transfer=0.3)) == pytest.approx(formula(p, m))
    # The last stage's forward 25 % slower: every microbatch waits for it, the bubble grows with m.
    slow_last = [instant_transfer_bubble(_gpipe(2, m, [1.0, 1.25], [2.0, 2.0])) for m in (4, 8)]
    assert slow_last[0] > formula(2, 4) and slow_last[1] - formula(2, 8) > slow_last[0] - formula(2, 4)


def test_rows_take_the_median_of_the_ranks_mean_and_drop_the_first_step():
    # p=2, m=4: formula 1/5. Step 0 (set-up) is left out; step 2 is an outlier the median drops.
    ranks = [{"gpipe": _rank(0, [0.9, 0.20, 0.60, 0.22], 4), "1f1b": _rank(0, [0.9, 0.30, 0.30, 0.30], 2)},
             {"gpipe": _rank(1, [0.9, 0.22, 0.60, 0.20], 4), "1f1b": _rank(1, [0.9, 0.30, 0.30, 0.30], 1)}]
    gpipe, one_f = rows_of((2, 4, 1024), ranks)
    assert formula(2, 4) == pytest.approx(0.2)
    assert gpipe["measured"] == pytest.approx(0.21) and gpipe["ok"] and gpipe["in_flight"] == 4
    assert one_f["ratio"] == pytest.approx(1.5) and not one_f["ok"] and one_f["in_flight_bound"] == 2
    text = table([gpipe, one_f])
    assert gpipe["instant"] == pytest.approx(0.2)  # the traces are balanced GPipe steps
    assert "| p2 m4 d1024 | gpipe | 21.0% | 20.0% | 1.05 | yes | 20.0% | 4 (4) |" in text
    assert "| p2 m4 d1024 | 1f1b | 30.0% | 20.0% | 1.50 | NO | 20.0% | 2 (2) |" in text


@pytest.mark.parametrize("text", ["2x8", "1x8x512", "2x8x30", "axbxc"])
def test_a_malformed_case_is_refused_with_its_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="PxMxD|P >= 2"):
        parse_case(text)


def test_the_replay_refuses_split_backwards_it_does_not_model():
    events = _gpipe(2, 2, [1.0, 1.0], [2.0, 2.0])
    events[1].append(ActionEvent("W", 1, 0, 9.0, 10.0))
    with pytest.raises(ValueError, match="split backwards"):
        instant_transfer_bubble(events)
