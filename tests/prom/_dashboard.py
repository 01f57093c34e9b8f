"""Reading the Grafana dashboard in deploy/grafana: its panels, its PromQL, its variables.

Shared by the structural checks (test_deploy.py) and the checks against a live Prometheus
(test_prometheus.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from monitor.metrics import JobMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/undying.json"
# A metric name; `undying_job` is the label every series names its job in.
METRIC_NAME = re.compile(r"\bundying_(?!job\b)[a-z0-9_]+\b")
# Grafana's own variables and what the tests put in their place (a 1 s scrape interval).
BUILTINS = {"__rate_interval": "30s", "__interval": "5s", "__range": "1h", "__range_s": "3600",
            "__interval_ms": "5000"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every Prometheus annotation query."""
    found = [(f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"])
             for p in panels(dashboard) for t in p.get("targets", [])]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


def rows(dashboard: dict) -> dict[int, str]:
    """Panel id -> the title of the row it sits under (rows are laid out top to bottom)."""
    out, title = {}, ""
    for panel in dashboard["panels"]:
        title = panel["title"] if panel["type"] == "row" else title
        out |= {nested["id"]: panel["title"] for nested in panel.get("panels", [])}
        out[panel["id"]] = title
    return out


def row_expressions(dashboard: dict, title: str) -> list[tuple[str, str]]:
    """`expressions` of the panels under the row named `title`."""
    under = {pid for pid, row in rows(dashboard).items() if row == title}
    return [(f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"])
            for p in panels(dashboard) if p["id"] in under for t in p.get("targets", [])]


def variables(dashboard: dict, job: str) -> dict[str, str]:
    """Values for every variable: `job` as given, `namespace` as Grafana sets it when the series carry
    none (a job outside Kubernetes: empty, which `=~` matches to the absent label), interval
    variables at their current value."""
    values = dict(BUILTINS, job=job, namespace="")
    for var in dashboard["templating"]["list"]:
        if var["type"] in ("interval", "constant", "custom"):
            values[var["name"]] = var["current"]["value"]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """`expr` with `$name`, `${name}` and `[[name]]` replaced; KeyError names an undefined one."""
    return _VARIABLE.sub(lambda m: values[next(g for g in m.groups() if g)], expr)


def exported_names() -> set[str]:
    """Every series name monitor/metrics.py and monitor/ps_metrics.py expose (counters as `_total`,
    histograms' three series), once the controller published its goodput ledger (the goodput series
    appear then)."""
    from monitor.goodput import GoodputLedger
    from monitor.ps_metrics import PSMetrics

    names, metrics = set(), JobMetrics("names")
    metrics.on_goodput(GoodputLedger())
    PSMetrics("names", "ssp", servers=1, registry=metrics.registry)  # a parameter-server job's, beside them
    for family in metrics.registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names
