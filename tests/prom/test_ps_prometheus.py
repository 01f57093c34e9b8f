"""A parameter-server job's exporter scraped by a real Prometheus: the staleness histogram counts
every update the servers applied, bucket by bucket, the byte counters equal the servers' own, and
the goodput ledger's productive time is exported while the job runs; the families pass `promtool
check metrics`. The driver feeds the exporter as `undying run` does (orchestrator/cli/ps_run.py:
`stats_feed`, run_ps's on_stats, while the workers run) and keeps serving after the job, so
Prometheus's last scrape sees the final counts. A local Ray and its actors take about half a
minute on two cores: heavy."""

from __future__ import annotations

import math
import time

import pytest

from monitor.goodput import GoodputLedger
from monitor.metrics import JobMetrics
from monitor.ps_metrics import PSMetrics
from orchestrator.cli.ps_run import stats_feed
from tests._ray_local import embedded_ray
from tests.prom._dashboard import load, row_expressions, substitute, variables
from tests.prom._promtool import lint, scrape
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

pytestmark = [pytest.mark.prom, pytest.mark.ray, pytest.mark.heavy, pytest.mark.timeout(300)]

JOB = "ps-prom"
MODEL = ModelConfig(preset="tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2, vocab_size=64, max_seq_len=32,
                    tie_embeddings=False)
TRAIN = TrainConfig(steps=30, global_batch=8, micro_batch=2, grad_clip=None, lr=3e-3)
PARALLEL = ParallelConfig(dp=2, mode="ps", servers=2, consistency="ssp", staleness=1)


def _wait_for(prom, expr: str, expected: float, timeout_s: float = 30.0) -> float | None:
    deadline, value = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        value = prom.value(expr)
        if value == expected:
            break
        time.sleep(0.5)
    return value


@pytest.fixture
def ray_local():
    with embedded_ray(num_cpus=4):
        yield


def test_prometheus_counts_every_update_of_a_ps_job(start_prometheus, ray_local):
    from paramserver.job import run_ps

    metrics = JobMetrics(JOB)
    ps_metrics = PSMetrics(JOB, PARALLEL.consistency, PARALLEL.servers, metrics.registry)
    port = metrics.serve("127.0.0.1", 0)
    try:
        prom = start_prometheus([f"127.0.0.1:{port}"])
        fed: list[int] = []
        ledger = GoodputLedger()
        feed = stats_feed(ps_metrics, metrics, ledger, every_steps=10)  # what `undying run` hands run_ps
        waits_seen: list[float] = []  # pull waits observed by each stats poll: during the run, not at its end

        def on_stats(stats) -> None:
            fed.append(feed(stats))
            waits_seen.append(metrics.registry.get_sample_value(
                "undying_ps_pull_wait_seconds_count", {"undying_job": JOB, "consistency": PARALLEL.consistency}))

        report = run_ps(MODEL, DataConfig(seq_len=16), TRAIN, PARALLEL, slow={0: 0.05}, stats_every_s=0.3,
                        on_stats=on_stats, ledger=ledger, on_step=lambda log: ps_metrics.on_steps([log]))
        assert 0 < waits_seen[len(waits_seen) // 2] < PARALLEL.dp * TRAIN.steps, waits_seen
        updates = len(report.records)
        assert updates == PARALLEL.dp * PARALLEL.servers * TRAIN.steps and sum(fed) == updates
        assert sum(1 for n in fed if n) >= 2, f"updates observed while the workers ran, per poll: {fed}"
        sel = f'{{undying_job="{JOB}"}}'
        assert _wait_for(prom, f"sum(undying_ps_update_staleness_count{sel})", updates) == updates
        fresh = sum(1 for r in report.records if r.staleness == 0)
        assert prom.value(f'sum(undying_ps_update_staleness_bucket{{undying_job="{JOB}", le="0.0"}})') == fresh
        stale_sum = sum(r.staleness for r in report.records)
        assert prom.value(f"sum(undying_ps_update_staleness_sum{sel})") == stale_sum
        pushed = sum(s.bytes_in for s in report.history.last.values())
        assert _wait_for(prom, f"sum(undying_ps_pushed_bytes_total{sel})", pushed) == pushed
        waits = PARALLEL.dp * TRAIN.steps
        assert _wait_for(prom, f"sum(undying_ps_pull_wait_seconds_count{sel})", waits) == waits
        assert (prom.value(f"max_over_time(undying_productive_seconds{sel}[5m])") or 0) > 0  # published as it ran
        assert (prom.value(f"undying_checkpoint_interval_seconds{sel}") or 0) > 0  # the no-commit alert's input
        assert lint(scrape(f"http://127.0.0.1:{port}/metrics")) == ""
        # The dashboard's parameter-server row draws this job: every query returns a number (over a window
        # that holds the run, which ended just now).
        dash = load()
        values = {**variables(dash, JOB), "__rate_interval": "5m"}
        drawn = row_expressions(dash, "Parameter server")
        assert len(drawn) >= 9, drawn  # the row's four panels, found under it
        blank = [where for where, expr in drawn
                 if not any(not math.isnan(float(s["value"][1])) for s in prom.query(substitute(expr, values)))]
        assert not blank, blank
    finally:
        metrics.close()
