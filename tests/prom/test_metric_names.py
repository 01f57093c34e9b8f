"""Every family monitor/metrics.py defines passes `promtool check metrics`, read from an exporter
fed every controller event so that each family has samples (the live job's scrape is checked too,
in test_prometheus.py, but a short job never sees some events: an evaluation, a forged message)."""

from __future__ import annotations

import pytest

from monitor.metrics import JobMetrics
from tests.prom._promtool import lint, scrape
from tests.unit.test_metrics import feed_every_event

pytestmark = pytest.mark.prom


def test_promtool_finds_nothing_to_flag_in_any_family():
    metrics = JobMetrics("lint")
    feed_every_event(metrics)
    port = metrics.serve("127.0.0.1", 0)
    try:
        text = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        metrics.close()
    assert "undying_eval_loss{" in text and "undying_control_messages_rejected_total{" in text
    assert lint(text) == ""


def test_promtool_flags_what_the_conventions_forbid():
    # The check can fail: a gauge named like a counter, and a counter without `_total`.
    text = ("# HELP undying_x_seconds_total x\n# TYPE undying_x_seconds_total gauge\nundying_x_seconds_total 1\n"
            "# HELP undying_y y\n# TYPE undying_y counter\nundying_y 1\n")
    report = lint(text)
    assert 'undying_x_seconds_total non-counter metrics should not have "_total" suffix' in report
    assert 'undying_y counter metrics should have "_total" suffix' in report
