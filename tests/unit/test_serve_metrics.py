"""A metrics port another process holds is a usage error naming monitor.port (exit 2), not a traceback; a
host that is no address of this machine names monitor.host, and a URL or an address with its port is
refused with the spec."""

from __future__ import annotations

import socket
import types

import pytest
from pydantic import ValidationError

from monitor.config import MonitorConfig
from monitor.metrics import JobMetrics
from orchestrator.cli.exits import serve_metrics


def _served(host: str, port: int) -> int | None:
    """serve_metrics' answer for a spec serving on host:port (the endpoint closed again)."""
    metrics = JobMetrics("serve-test")
    try:
        return serve_metrics(metrics, types.SimpleNamespace(monitor=types.SimpleNamespace(host=host, port=port)))
    finally:
        metrics.close()


def test_a_port_in_use_is_refused_naming_monitor_port(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert _served("127.0.0.1", port) is None
    err = capsys.readouterr().err
    assert "monitor.port" in err and f"127.0.0.1:{port}" in err and "0 for any" in err
    assert _served("127.0.0.1", 0) > 0


@pytest.mark.parametrize("host, words", [("192.0.2.1", "is not an address of this machine"),
                                         ("no-such-host.invalid", "does not resolve")])
def test_a_host_that_is_not_this_machine_s_is_refused_naming_monitor_host(capsys, monkeypatch, host, words):
    def no_resolver(name, *args, **kwargs):  # the lookup a resolver would answer NXDOMAIN, without the network
        if name == "no-such-host.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return resolve(name, *args, **kwargs)

    resolve = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", no_resolver)
    assert _served(host, 0) is None
    err = capsys.readouterr().err
    assert "monitor.host" in err and words in err and "monitor.port" not in err


@pytest.mark.parametrize("host, words", [("http://0.0.0.0", "is a URL"), ("0.0.0.0:9090", "as monitor.port")])
def test_a_url_or_an_address_with_its_port_is_refused_with_the_spec(host, words):
    with pytest.raises(ValidationError, match=words):
        MonitorConfig(host=host)
    assert MonitorConfig(host="::1").host == "::1"  # IPv6 literals have colons
