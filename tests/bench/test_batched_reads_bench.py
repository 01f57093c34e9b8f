"""bench.data.batched_reads: the table from a result (fast), and one small run on the real SeaweedFS
server it starts (both ways read the same windows' worth of steps, and the table has every number)."""

from __future__ import annotations

import pytest

from bench.data.batched_reads import measure, table


def test_the_table_puts_each_way_against_the_one_by_one_anchor():
    result = {"steps": 10, "windows": 80, "rounds": 3,
              "seconds": {"one by one": [2.0, 1.0, 3.0], "batched": [0.4, 0.6, 0.5]}}
    text = table(result)
    assert "| one by one (anchor) | 2.00 | 40 | 200.0 | **1.00x** |" in text
    assert "| batched, read_many (ours) | 0.50 | 160 | 50.0 | **4.00x** |" in text


@pytest.mark.s3
def test_a_small_run_against_seaweedfs_measures_both_ways():
    result = measure(steps=3, rounds=1)
    assert result["windows"] == 3 * 8 and set(result["seconds"]) == {"one by one", "batched"}
    assert all(t[0] > 0 for t in result["seconds"].values())
    assert "read_many (ours)" in table(result)
