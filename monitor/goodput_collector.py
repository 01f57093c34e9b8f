"""The goodput ledger's totals as Prometheus series: a custom collector, read on the exporter's threads.

Protocol: monitor.metrics.JobMetrics registers one per job and hands it the ledger's reading
(`publish`, from the controller's thread, under a lock); scrapes `collect`, which extends the
reading's open interval to the scrape, so the series move during an outage too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from monitor.goodput import BADPUT_CAUSES, PRODUCTIVE, LedgerReading


class GoodputCollector:
    """Exposes the ledger totals published by `on_goodput`.

    Badput is a counter, `undying_badput_seconds_total{cause}`, of the seconds booked by this
    process: the ledger only ever adds to a cause (time booked as it passes, `move` always takes
    from `productive`), so `rate()` and `increase()` read it. It starts at 0 in each driver
    process, as a counter must: a resumed driver's base is what its predecessors booked as they
    booked it (`LedgerReading.prior`, from a snapshot up to seconds old, below what the last one
    exported; exporting those would read as a counter reset followed by an increase of the job's
    whole history: the low-goodput alert's false fire after every resume). What the resume itself
    books (the predecessor's steps past the restored commit, now lost work; the time no driver
    ran) is this process's increase. The job's totals across its drivers are the gauge
    `undying_badput_job_seconds{cause}` (dashboards' shares). Productive time is a gauge,
    `undying_productive_seconds`, the job's, because `move` shrinks it when rolled-back steps
    become `lost_work`; use `delta()` on it. `undying_goodput_ratio` is productive over wall.

    Before the first `publish`, which the controller makes once the ledger is whole (after its first
    restore carried a predecessor's totals, or found none), only the counter is exported, at 0 for every
    cause: then what the resume books is an increase Prometheus sees (a counter's first sample is not),
    also on a new pod's new series. The counter never goes down: a scrape that extended the open
    interval past the moment the controller then closed it exported a little more than the closed
    reading holds, and is kept until the counter passes it (a dip would read as a reset, and
    `increase()` would count the cause's whole total again).
    """

    def __init__(self, job: str) -> None:
        self._job = job
        self._lock = threading.Lock()
        self._reading: LedgerReading | None = None
        self._exported: dict[str, float] = dict.fromkeys(BADPUT_CAUSES, 0.0)  # the counter's values, per cause

    def publish(self, reading: LedgerReading) -> None:
        """The ledger's reading (GoodputLedger.reading), taken on the controller's thread."""
        with self._lock:
            self._reading = reading

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            reading = self._reading
            totals = reading.totals() if reading is not None else {}
            base = reading.prior if reading is not None else {}
            for cause in BADPUT_CAUSES:  # under the lock: two scrapes at once must not export out of order
                own = totals.get(cause, 0.0) - base.get(cause, 0.0)
                self._exported[cause] = max(self._exported[cause], own)
            exported = dict(self._exported)
        badput = CounterMetricFamily(
            "undying_badput_seconds",
            "Wall seconds this driver process booked to each badput cause (ml-goodput-measurement "
            "taxonomy); from 0 in each process: rate() and increase() read it across resumes.",
            labels=["cause", "undying_job"],
        )
        job_badput = GaugeMetricFamily(
            "undying_badput_job_seconds",
            "Wall seconds the job booked to each badput cause, over every driver process it had.",
            labels=["cause", "undying_job"],
        )
        for cause in BADPUT_CAUSES:
            badput.add_metric([cause, self._job], exported[cause])
            job_badput.add_metric([cause, self._job], totals.get(cause, 0.0))
        if reading is None:
            yield badput
            return
        productive = GaugeMetricFamily(
            "undying_productive_seconds",
            "Wall seconds of training whose effect survives in the final model (shrinks when a "
            "recovery rolls steps back).",
            labels=["undying_job"],
        )
        productive.add_metric([self._job], totals.get(PRODUCTIVE, 0.0))
        ratio = GaugeMetricFamily("undying_goodput_ratio", "Productive seconds / wall seconds.", labels=["undying_job"])
        wall = sum(totals.values())
        ratio.add_metric([self._job], totals.get(PRODUCTIVE, 0.0) / wall if wall > 0 else 0.0)
        yield badput
        yield job_badput
        yield productive
        yield ratio
