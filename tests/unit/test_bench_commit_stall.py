"""bench.commit_stall at a toy size: every way commits, retention keeps the newest two, and the table
says the controller's thread spends less of a slow store's latency the more store work runs beside it."""

from __future__ import annotations

from bench import commit_stall


def test_store_work_beside_the_controller_takes_the_slow_calls_off_its_thread():
    rows = {way: commit_stall.measure(0.02, commits=2, ranks=2, way=way) for way in commit_stall.WAYS}
    # Inline the commit waits for the create, its read-back and the pass's listings, stats and deletes
    # (each 20 ms); with retention beside it, for the create and read-back; with the lane, for none.
    assert rows["inline"]["stall"] > 0.1 and rows["beside"]["stall"] >= 0.04 > rows["lane"]["stall"]
    assert rows["lane"]["lands"] >= 0.04  # the create's calls, paid off the thread
    table = commit_stall.table([{"latency_ms": 20.0, **rows}])
    assert table.splitlines()[2].startswith("| 20 ms | ")
