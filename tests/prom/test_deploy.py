"""The monitoring files in deploy/: the Grafana dashboard's structure, and the Prometheus config
checked by promtool and against the KubeRay PodMonitor's port. The image, the KubeRay manifests
and the Ray cluster config are checked by tests/unit/test_deploy_*.py."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from tests.prom._dashboard import BUILTINS, METRIC_NAME, ROOT, exported_names, expressions, load, panels

DEPLOY = ROOT / "deploy"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# What monitor/metrics.py and monitor/ps_metrics.py export that no panel draws, and why.
NOT_DRAWN = {"undying_run_start_timestamp_seconds": "the dashboard's job variable lists the jobs by it"}


def _metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def test_dashboard_header_and_variables():
    dash = load()
    assert 36 <= dash["schemaVersion"] <= 41 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query" and job["datasource"] == DATASOURCE
    # Every job from its start: one stuck before its first step (startup, a restore) is listed too.
    listed = 'label_values(undying_run_start_timestamp_seconds{namespace=~"$namespace"}, undying_job)'
    assert job["definition"] == job["query"]["query"] == listed
    # Jobs of one name in two namespaces are two jobs: the namespace is chosen first, one at a time.
    namespace = variables["namespace"]
    assert [v["name"] for v in dash["templating"]["list"]].index("namespace") < list(variables).index("job")
    assert namespace["query"]["query"] == "label_values(undying_run_start_timestamp_seconds, namespace)"
    assert not namespace["multi"] and not namespace["includeAll"]


def test_every_panel_is_complete_and_unique():
    dash = load()
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for panel in panels(dash):
        grid = panel["gridPos"]
        assert {k: type(grid[k]) for k in "hwxy"} == dict.fromkeys("hwxy", int), panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), panel["title"]


def test_panels_do_not_overlap():
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(load()):
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r} at x={x} y={y}"
                cells[(x, y)] = panel["title"]


def test_every_metric_in_the_dashboard_is_defined_in_monitor_metrics():
    defined = exported_names()
    undefined = {(where, name) for where, expr in expressions(load()) for name in _metric_names(expr)
                 if name not in defined}
    assert not undefined, "metrics the dashboard queries but monitor/metrics.py does not define:\n" + "\n".join(
        f"  {name} ({where})" for where, name in sorted(undefined))


def test_dashboard_shows_every_exported_metric():
    # Read from the registries, not a list kept by hand: a series added to monitor/ without a panel fails here.
    family = lambda name: re.sub(r"_(bucket|sum|count)$", "", name)  # noqa: E731 (a histogram's three series)
    used = {family(name) for _, expr in expressions(load()) for name in _metric_names(expr)}
    missing = sorted({family(name) for name in exported_names()} - used - set(NOT_DRAWN))
    assert not missing, f"no panel shows {missing}"
    dashboard = json.dumps(load())
    assert all(name in dashboard for name in NOT_DRAWN), "NOT_DRAWN names a series the dashboard does not use"


def test_every_variable_in_a_query_is_defined():
    dash = load()
    defined = set(BUILTINS) | {v["name"] for v in dash["templating"]["list"]}
    for where, expr in expressions(dash):
        used = {m for groups in re.findall(r"\$\{(\w+)|\$(\w+)|\[\[(\w+)\]\]", expr) for m in groups if m}
        assert used <= defined, f"{where}: undefined variables {used - defined}"
        assert 'undying_job="$job"' in expr, f"{where} does not select the dashboard's job: {expr}"
        selectors = re.findall(r"\{[^{}]*\}", expr)
        unscoped = [s for s in selectors if "undying_job" in s and 'namespace=~"$namespace"' not in s]
        assert not unscoped, f"{where} selects a job's name without its namespace: {unscoped}"
        groupings = re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr)
        assert all("namespace" in g for g in groupings if "undying_job" in g), f"{where} joins jobs across namespaces"


def _uncomment_examples(text: str) -> str:
    """The scrape config with its commented-out examples (lines `  # - ...`, `  #   ...`) enabled."""
    return "\n".join(re.sub(r"^  # ( {2,}\S.*|- .*)$", r"  \1", line) for line in text.splitlines())


def test_prometheus_config_and_examples_parse():
    text = (DEPLOY / "prometheus/prometheus.yml").read_text()
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "5s"
    [undying] = config["scrape_configs"]
    # The job's name is the series' `undying_job` label: Prometheus keeps its own `job`.
    assert "honor_labels" not in undying and undying["static_configs"][0]["targets"]
    jobs = {job["job_name"]: job for job in yaml.safe_load(_uncomment_examples(text))["scrape_configs"]}
    assert set(jobs) == {"undying", "ray", "undying-kuberay"}
    assert "honor_labels" not in jobs["undying-kuberay"]
    keep = [r["regex"] for r in jobs["undying-kuberay"]["relabel_configs"] if r.get("action") == "keep"]
    podmonitor = yaml.safe_load((DEPLOY / "kuberay/podmonitor.yaml").read_text())
    assert keep == ["head", podmonitor["spec"]["podMetricsEndpoints"][0]["port"]]


@pytest.mark.prom
def test_promtool_accepts_the_scrape_config():
    if not os.path.exists("/usr/bin/promtool"):
        pytest.fail("/usr/bin/promtool is missing: run `make servers` (scripts/install-servers.sh)")
    check = subprocess.run(["/usr/bin/promtool", "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
