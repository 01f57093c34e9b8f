"""The alert rules of deploy/prometheus/alerts.yml: checked and unit-tested by promtool (each alert
fires on a synthetic sick job and stays silent on a healthy one, alerts_test.yml), loaded by the
deploy config, and written only against series that monitor/metrics.py serves."""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.prom._dashboard import METRIC_NAME, ROOT, exported_names

PROMTOOL = "/usr/bin/promtool"
RULES = ROOT / "deploy/prometheus/alerts.yml"
CASES = ROOT / "deploy/prometheus/alerts_test.yml"
ALERTS = {"UndyingNoCheckpointCommit", "UndyingCheckpointSaveFailures", "UndyingLowGoodput", "UndyingRestartStorm",
          "UndyingStraggler", "UndyingControlMessagesRejected", "UndyingControlMessagesMissing"}


def _promtool(*args: str) -> str:
    if not os.path.exists(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is missing: run `make servers` (scripts/install-servers.sh)")
    run = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@pytest.mark.prom
def test_promtool_checks_the_rules():
    assert f"SUCCESS: {len(ALERTS)} rules found" in _promtool("check", "rules", str(RULES))


@pytest.mark.prom
def test_promtool_unit_tests_pass_and_cover_every_alert():
    assert "SUCCESS" in _promtool("test", "rules", str(CASES))
    tested = {case["alertname"] for test in yaml.safe_load(CASES.read_text())["tests"]
              for case in test["alert_rule_test"]}
    assert tested == {rule["alert"] for rule in _rules()} == ALERTS
    for test in yaml.safe_load(CASES.read_text())["tests"]:
        # Each group of cases has a quiet one (nothing fires) and one where the alert fires.
        outcomes = {bool(case["exp_alerts"]) for case in test["alert_rule_test"]}
        assert outcomes == {True, False}, test["alert_rule_test"][0]["alertname"]


def test_the_deploy_config_loads_the_rules():
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert config["rule_files"] == [RULES.name]
    assert yaml.safe_load(CASES.read_text())["rule_files"] == [RULES.name]


def test_rules_use_only_series_that_monitor_metrics_serves():
    served = exported_names()
    for rule in _rules():
        used = set(METRIC_NAME.findall(rule["expr"]))
        mentioned = {name for text in rule["annotations"].values() for name in METRIC_NAME.findall(text)}
        assert used, rule["alert"]
        assert used | mentioned <= served, f"{rule['alert']}: not served: {sorted((used | mentioned) - served)}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert "{{ $labels.undying_job }}" in rule["annotations"]["summary"]


def test_the_operators_prometheusrule_holds_the_same_rules_and_comments():
    rule = yaml.safe_load((ROOT / "deploy/kuberay/prometheusrule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    # Comments too: the thresholds' reasons travel with the rules (the same lines, indented once more).
    rules_text = RULES.read_text()
    body = rules_text[rules_text.index("groups:\n") + len("groups:\n"):].splitlines()
    operator_text = (ROOT / "deploy/kuberay/prometheusrule.yaml").read_text()
    assert operator_text.split("  groups:\n", 1)[1].splitlines() == [f"  {line}" if line.strip() else line
                                                                      for line in body]
