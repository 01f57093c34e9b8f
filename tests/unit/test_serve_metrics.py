"""A metrics port another process holds is a usage error naming monitor.port (exit 2), not a traceback."""

from __future__ import annotations

import socket
import types

from monitor.metrics import JobMetrics
from orchestrator.cli.exits import serve_metrics


def test_a_port_in_use_is_refused_naming_monitor_port(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        spec = types.SimpleNamespace(monitor=types.SimpleNamespace(host="127.0.0.1", port=port))
        metrics = JobMetrics("busy-port")
        try:
            assert serve_metrics(metrics, spec) is None
        finally:
            metrics.close()
    err = capsys.readouterr().err
    assert "monitor.port" in err and f"127.0.0.1:{port}" in err and "0 for any" in err
    free = types.SimpleNamespace(monitor=types.SimpleNamespace(host="127.0.0.1", port=0))
    metrics = JobMetrics("free-port")
    try:
        assert serve_metrics(metrics, free) > 0
    finally:
        metrics.close()
