"""bench.commit_stall at a toy size: both ways commit, retention keeps the newest two, and the table
says the controller's thread spends less of a slow store's latency with retention beside it."""

from __future__ import annotations

from bench import commit_stall


def test_retention_beside_the_controller_takes_the_slow_calls_off_its_thread():
    inline = commit_stall.measure(0.02, commits=2, ranks=2, background=False)
    beside = commit_stall.measure(0.02, commits=2, ranks=2, background=True)
    # Inline the commit waits for the pass's listings, stats and deletes (each 20 ms); beside it does not.
    assert beside["stall"] < inline["stall"] and inline["stall"] > 0.1
    table = commit_stall.table([{"latency_ms": 20.0, "inline": inline, "beside": beside}])
    assert table.splitlines()[2].startswith("| 20 ms | ")
