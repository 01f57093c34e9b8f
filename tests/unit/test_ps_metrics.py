"""PSMetrics: the staleness histogram and byte counters of a parameter-server job, read back from
the exposition text Prometheus would scrape."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitor.metrics import JobMetrics
from monitor.ps_metrics import PSMetrics, StepRate
from paramserver.actors import ServerStats, StepLog
from paramserver.clocks import UpdateRecord

JOB = "ps-demo"


def _stats(server: int, stalenesses: list[int], bytes_in: int = 0, bytes_out: int = 0, first: int = 0) -> ServerStats:
    """A server's answer: the records of steps first.. (new since its last answer), its counters."""
    records = [UpdateRecord(server, worker=i % 2, step=i, pulled_version=i, applied_version=i + s, slowest_at_pull=i)
               for i, s in enumerate(stalenesses, start=first)]
    return ServerStats(server, first + len(records), bytes_in, bytes_out, records)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without undying_job): value} from the exposition text."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("undying_job") == JOB
            out[sample.name, tuple(sorted(labels.items()))] = sample.value
    return out


def _bucket(server: int, le: str) -> tuple[str, tuple]:
    return "undying_ps_update_staleness_bucket", (("consistency", "ssp"), ("le", le), ("server", str(server)))


def _series(name: str, server: int) -> tuple[str, tuple]:
    return name, (("consistency", "ssp"), ("server", str(server)))


def test_histogram_counts_each_update_once_as_the_answers_bring_them():
    registry = CollectorRegistry()
    metrics = PSMetrics(JOB, "ssp", servers=2, registry=registry)
    before = _samples(registry)
    # Every series exists before the first update, at zero.
    assert before[_series("undying_ps_update_staleness_count", 1)] == 0
    assert before[_series("undying_ps_pushed_bytes_total", 1)] == 0
    assert metrics.on_server_stats([_stats(0, [0, 0, 1]), _stats(1, [2])]) == 4
    assert metrics.on_server_stats([_stats(0, [], first=3), _stats(1, [], first=1)]) == 0  # nothing new
    assert metrics.on_server_stats([_stats(0, [3, 5], 700, 900, first=3), _stats(1, [0], 300, 100, first=1)]) == 3
    samples = _samples(registry)
    assert samples[_series("undying_ps_update_staleness_count", 0)] == 5
    assert samples[_series("undying_ps_update_staleness_sum", 0)] == 9
    cumulative = [samples[_bucket(0, le)] for le in ("0.0", "1.0", "2.0", "3.0", "4.0", "6.0", "+Inf")]
    assert cumulative == [2, 3, 3, 4, 4, 5, 5]
    assert samples[_series("undying_ps_update_staleness_count", 1)] == 2
    assert samples[_bucket(1, "0.0")] == 1 and samples[_bucket(1, "2.0")] == 2
    assert samples[_series("undying_ps_pushed_bytes_total", 0)] == 700
    assert samples[_series("undying_ps_pulled_bytes_total", 1)] == 100
    assert samples[_series("undying_ps_server_version", 0)] == 5


def test_a_rollback_counts_the_redone_updates_and_a_new_actor_its_bytes():
    registry = CollectorRegistry()
    metrics = PSMetrics(JOB, "ssp", servers=1, registry=registry)
    metrics.on_server_stats([_stats(0, [0, 1, 1, 2], 400, 400)])
    # Rolled back to a commit after its first two updates, by a new actor (counters from zero).
    assert metrics.on_server_stats([_stats(0, [], 100, 50, first=2)]) == 0
    # The redone updates arrive as new records.
    assert metrics.on_server_stats([_stats(0, [3, 3, 1], 300, 250, first=2)]) == 3
    samples = _samples(registry)
    assert samples[_series("undying_ps_update_staleness_count", 0)] == 7  # every update applied
    assert samples[_series("undying_ps_update_staleness_sum", 0)] == 4 + 7
    assert samples[_series("undying_ps_pushed_bytes_total", 0)] == 700
    assert samples[_series("undying_ps_pulled_bytes_total", 0)] == 650


def test_pull_waits_and_the_job_series_share_one_registry():
    job = JobMetrics(JOB)
    metrics = PSMetrics(JOB, "ssp", servers=1, registry=job.registry)
    metrics.on_steps([StepLog(w, 0, 1.0, 4, wait, 0.01, 0.01, 0.0) for w, wait in enumerate((0.004, 0.2, 3.0))])
    samples = _samples(job.registry)
    wait = (("consistency", "ssp"),)
    assert samples["undying_ps_pull_wait_seconds_count", wait] == 3
    assert samples["undying_ps_pull_wait_seconds_bucket", (*wait, ("le", "0.01"))] == 1
    assert samples["undying_ps_pull_wait_seconds_bucket", (*wait, ("le", "0.25"))] == 2
    assert ("undying_step_seconds_count", ()) in samples  # the collective job's families are served beside them


def test_the_step_rate_gives_the_interval_between_commits_and_restarts_after_a_rollback():
    now = [100.0]
    rate = StepRate(clock=lambda: now[0])
    assert rate.on_stats([ServerStats(0, 0, 0, 0, [])]) is None  # nothing applied yet
    assert rate.on_stats([_stats(0, [0] * 5), _stats(1, [0] * 3)]) is None  # the origin: step 4 at t=100
    now[0] = 102.0
    assert rate.on_stats([_stats(0, [0] * 25), _stats(1, [0] * 20)]) == 10.0  # 20 steps in 2 s
    now[0] = 103.0
    assert rate.on_stats([_stats(0, [0] * 11)]) == 10.0  # rolled back to step 10 (above the first): from here
    now[0] = 105.0
    assert rate.on_stats([_stats(0, [0] * 21)]) == 5.0


def test_a_ps_job_exports_the_job_step_series_once_every_worker_s_log_of_a_step_is_in():
    # The dashboard draws every job's step, tokens and loss: a parameter-server job
    # exports them as a collective one does, from its workers' step logs.
    from orchestrator.cli.ps_run import step_feed

    job = JobMetrics(JOB)
    on_step = step_feed(PSMetrics(JOB, "ssp", servers=1, registry=job.registry), job, workers=2)
    sample = {"undying_job": JOB}
    on_step(StepLog(0, 0, loss_sum=8.0, tokens=4, pull_wait_s=0.1, compute_s=0.2, push_s=0.1, finished_at=1.0))
    assert job.registry.get_sample_value("undying_step", sample) is None  # worker 1's step 0 not in yet
    on_step(StepLog(1, 0, loss_sum=4.0, tokens=4, pull_wait_s=0.3, compute_s=0.2, push_s=0.1, finished_at=1.0))
    assert job.registry.get_sample_value("undying_step", sample) == 1  # one step done
    assert job.registry.get_sample_value("undying_tokens_total", sample) == 8
    assert job.registry.get_sample_value("undying_loss", sample) == 1.5  # token-weighted: 12 / 8
    assert job.registry.get_sample_value("undying_step_seconds_sum", sample) == pytest.approx(0.6)  # the slowest
    wait = {"undying_job": JOB, "consistency": "ssp"}
    assert job.registry.get_sample_value("undying_ps_pull_wait_seconds_count", wait) == 2
