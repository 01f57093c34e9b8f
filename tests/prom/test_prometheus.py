"""A real job scraped by a real Prometheus: every metric the controller promises reaches Prometheus, and every
PromQL query of the Grafana dashboard returns data through Prometheus's HTTP API.

One job (4 ranks on an embedded local Ray, rank 1 killed at step 30 so failure and recovery
series exist, a checkpoint every 2 s) runs for the whole module; the checks run while it is
still training, since the controller stops serving metrics when the job ends. Its exporter's own
scrape passes `promtool check metrics` without a warning."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.prom._dashboard import ROOT, expressions, load, row_expressions, substitute, variables
from tests.prom._promtool import lint, scrape

pytestmark = [pytest.mark.prom, pytest.mark.timeout(600)]

JOB = "promtest"
SEL = f'{{undying_job="{JOB}"}}'
UNDYING = os.path.join(os.path.dirname(sys.executable), "undying")
# The metrics the controller promises (every one a panel draws: tests/prom/test_deploy.py), as series names in
# Prometheus (a histogram is its `_bucket`, `_sum`, `_count`).
HISTOGRAMS = ("undying_step_seconds", "undying_checkpoint_blocking_seconds",
              "undying_checkpoint_commit_latency_seconds", "undying_detection_seconds", "undying_recovery_seconds")
REQUIRED_SERIES = (
    "undying_step", "undying_tokens_total", "undying_mfu_ratio", "undying_loss", "undying_grad_norm",
    "undying_loss_scale", "undying_goodput_ratio", "undying_badput_seconds_total", "undying_badput_job_seconds",
    "undying_productive_seconds",
    "undying_checkpoint_bytes",
    "undying_checkpoint_last_committed_step", "undying_checkpoint_interval_seconds",
    "undying_checkpoint_failures_total", "undying_checkpoint_last_commit_timestamp_seconds",
    "undying_run_start_timestamp_seconds",
    "undying_checkpoint_skipped_total", "undying_failures_total", "undying_generation", "undying_world_size",
    "undying_parallel_degree", "undying_pipeline_bubble_ratio", "undying_memory_bytes",
    "undying_rank_step_compute_seconds", "undying_straggler", "undying_straggler_ratio", "undying_recoveries_total",
    "undying_memory_snapshot_step", "undying_memory_snapshot_host_bytes",
    *(f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")),
)
BADPUT_CAUSES = {"startup", "checkpoint_save", "checkpoint_restore", "detection", "reformation", "lost_work",
                 "waiting_for_resources", "data", "other"}
# Scrapes (1 s apart) of the running job, and of it after its recovery, before the checks.
MIN_SCRAPES, MIN_SCRAPES_AFTER_RECOVERY = 40, 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_session(sid: int) -> None:
    """SIGKILL what is left of the session the job led (its embedded Ray), found by PID through /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def _start_job(tmp, port: int) -> subprocess.Popen:
    sets = [f"name={JOB}", f"monitor.port={port}", "train.steps=5000", f"checkpoint.url=file://{tmp}/ckpt",
            "checkpoint.every_steps=null", "checkpoint.interval=2", "elastic.spares=0",
            "checkpoint.memory={enabled: true, every_steps: 5}",
            "chaos.faults=[{kind: kill_rank, rank: 1, at_step: 30}]"]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml")]
    for item in sets:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # embedded local Ray
    with (tmp / "job.log").open("wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True)


def _stop_job(proc: subprocess.Popen) -> None:
    """SIGINT first so the job shuts its Ray down itself; then whatever is left, by session."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    _kill_session(proc.pid)
    proc.wait(timeout=30)


def _scrapes(prom, series: str) -> float:
    return prom.value(f"count_over_time({series}{SEL}[10m])") or 0.0


def _wait_for_history(prom, proc, log, timeout_s: float = 420.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before Prometheus had enough of it:\n"
                        f"{log.read_text()[-4000:]}")
        if (_scrapes(prom, "undying_step") >= MIN_SCRAPES
                and _scrapes(prom, "undying_recovery_seconds_count") >= MIN_SCRAPES_AFTER_RECOVERY):
            return
        time.sleep(2.0)
    pytest.fail(f"no recovered, scraped job after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def scraped(start_prometheus, tmp_path_factory):
    """(prometheus, job process, the job's metrics URL) with the job still running and scraped for a while."""
    tmp = tmp_path_factory.mktemp("job")
    port = _free_port()
    prom = start_prometheus([f"127.0.0.1:{port}"])
    proc = _start_job(tmp, port)
    try:
        started = time.monotonic()
        _wait_for_history(prom, proc, tmp / "job.log")
        print(f"job scraped with a recovery after {time.monotonic() - started:.0f} s")
        yield prom, proc, f"http://127.0.0.1:{port}/metrics"
        assert proc.poll() is None, "the job ended during the checks: raise train.steps"
    finally:
        _stop_job(proc)


def _finite(result: list[dict]) -> bool:
    return any(not math.isnan(float(series["value"][1])) for series in result)


def test_every_required_metric_is_scraped(scraped):
    prom, *_ = scraped
    present = {s["metric"]["__name__"] for s in prom.query(f'count({{__name__=~"undying_.*", undying_job="{JOB}"}}) '
                                                            "by (__name__)")}
    missing = [name for name in REQUIRED_SERIES if name not in present]
    assert not missing, f"not exported by the running job: {missing}"


def test_labelled_metrics_have_every_label_value(scraped):
    prom, *_ = scraped
    labels = {metric: {s["metric"][label] for s in prom.query(f"{metric}{SEL}")}
              for metric, label in (("undying_badput_seconds_total", "cause"), ("undying_parallel_degree", "dim"))}
    assert labels == {"undying_badput_seconds_total": BADPUT_CAUSES, "undying_parallel_degree": {"dp", "tp", "pp"}}
    ledgers = {(s["metric"]["ledger"], s["metric"]["kind"]) for s in prom.query(f"undying_memory_bytes{SEL}")}
    assert ledgers == {(ledger, kind) for ledger in ("state", "activation", "collective", "transient")
                       for kind in ("predicted", "measured")}


def test_values_describe_the_job(scraped):
    prom, *_ = scraped
    assert prom.value(f"undying_world_size{SEL}") == 4
    assert prom.value(f'undying_parallel_degree{{undying_job="{JOB}", dim="dp"}}') == 4
    assert prom.value(f"undying_generation{SEL}") >= 1
    assert prom.value(f'undying_failures_total{{undying_job="{JOB}", kind="kill_rank"}}') >= 1
    assert prom.value(f"sum(undying_controller_state{SEL})") == 1, "exactly one state is current"
    assert prom.value(f'undying_controller_state{{undying_job="{JOB}", state="RECOVERING"}}') == 0
    assert prom.value(f"undying_checkpoint_last_committed_step{SEL}") > 0
    assert 0 < prom.value(f"undying_goodput_ratio{SEL}") < 1
    assert prom.value(f"undying_tokens_total{SEL}") > 0 and prom.value(f"rate(undying_tokens_total{SEL}[30s])") > 0
    assert prom.value('up{job="undying"}') == 1
    # Without honor_labels: `job` is the scrape job's, and nothing was renamed to exported_job.
    assert prom.value(f'count(undying_step{{undying_job="{JOB}", job="undying"}})') == 1
    assert prom.query('{__name__=~"undying_.*", exported_job!=""}') == []


def test_the_dashboards_job_variable_lists_the_job(scraped):
    prom, *_ = scraped
    # label_values(undying_run_start_timestamp_seconds{namespace=~"$namespace"}, undying_job), with no
    # namespace label outside Kubernetes: the namespace variable is empty, and the job is listed.
    assert prom.label_values("namespace", "undying_run_start_timestamp_seconds") == []
    assert prom.label_values("undying_job", 'undying_run_start_timestamp_seconds{namespace=~""}') == [JOB]


# Panels this job cannot fill, and where their queries are checked against a live Prometheus instead.
OTHER_JOBS = {"Parameter server": "a parameter-server job's series: tests/prom/test_ps_prometheus.py"}
NOT_THIS_JOB = {"Validation loss": "the job has no eval section (a prepared held-out dataset)"}


def test_every_dashboard_query_returns_data(scraped):
    prom, *_ = scraped
    dash = load()
    values = variables(dash, JOB)
    elsewhere = {where for title in OTHER_JOBS for where, _ in row_expressions(dash, title)}
    problems = []
    for where, expr in expressions(dash):
        if where in elsewhere or any(f"{title!r}" in where for title in NOT_THIS_JOB):
            continue
        query = substitute(expr, values)
        result = prom.query(query)
        if not result:
            problems.append(f"empty     {where}: {query}")
        elif not _finite(result):
            problems.append(f"only NaN  {where}: {query}")
    assert not problems, f"{len(problems)} dashboard queries show nothing:\n" + "\n".join(problems)


def test_promtool_finds_nothing_to_flag_in_the_live_scrape(scraped):
    *_, url = scraped
    text = scrape(url)
    assert "undying_step_seconds_bucket{" in text and "undying_badput_seconds_total{" in text
    assert lint(text) == ""
