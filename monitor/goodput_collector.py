"""The goodput ledger's totals as Prometheus series: a custom collector, read on the exporter's threads.

Protocol: monitor.metrics.JobMetrics registers one per job and hands it a snapshot of the
ledger's totals (`publish`, from the controller's thread, under a lock); scrapes `collect`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from monitor.goodput import BADPUT_CAUSES, PRODUCTIVE


class GoodputCollector:
    """Exposes the ledger totals published by `on_goodput`.

    Badput is a counter, `undying_badput_seconds_total{cause}`: the ledger only ever adds to a
    cause (time booked as it passes, `move` always takes from `productive`), so `rate()` reads
    it. Productive time is a gauge, `undying_productive_seconds`, because `move` shrinks it when
    rolled-back steps become `lost_work`, and Prometheus would read a counter's decrease as a
    process restart and turn `rate()` into a spike; use `delta()` on it.

    Nothing is exported before the first `publish`, which the controller makes once the ledger
    is whole (after its first restore carried a predecessor's totals, or found none): zeros
    exported before that carry, then the carried totals, read as a counter reset followed by an
    increase of the job's whole history, which fired the low-goodput alert at every resume.
    """

    def __init__(self, job: str) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._totals: dict[str, float] | None = None

    def publish(self, totals: Mapping[str, float]) -> None:
        with self._lock:
            self._totals = dict(totals)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            totals = None if self._totals is None else dict(self._totals)
        if totals is None:
            return
        badput = CounterMetricFamily(
            "undying_badput_seconds",
            "Wall seconds booked to each badput cause (ml-goodput-measurement taxonomy).",
            labels=["cause", "undying_job"],
        )
        for cause in BADPUT_CAUSES:
            badput.add_metric([cause, self._job], totals.get(cause, 0.0))
        productive = GaugeMetricFamily(
            "undying_productive_seconds",
            "Wall seconds of training whose effect survives in the final model (shrinks when a "
            "recovery rolls steps back).",
            labels=["undying_job"],
        )
        productive.add_metric([self._job], totals.get(PRODUCTIVE, 0.0))
        yield badput
        yield productive
