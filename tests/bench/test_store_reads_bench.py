"""bench.store_reads on a few ranks: both reads agree and the table says what was measured."""

from __future__ import annotations

from bench.store_reads import measure, table


def test_both_reads_return_every_heartbeat_and_the_table_reports_them():
    row = measure(ranks=16, repeats=2)  # raises when the two reads disagree
    assert row["ranks"] == 16 and row["per_key"] > 0 and row["batched"] > 0
    text = table([row])
    assert text.splitlines()[2].startswith("| 16 | ") and text.count("|") == 21
