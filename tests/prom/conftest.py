"""A real Prometheus server for the `prom` tests (Debian's package, installed by
`make servers`): started here on a free 127.0.0.1 port with its own config and TSDB in a temp
dir, scraping the targets a test passes in, and stopped by the PID we launched."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PROMETHEUS = Path("/usr/bin/prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """HTTP API client of one running server (https://prometheus.io/docs/prometheus/latest/querying/api/)."""

    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def _get(self, path: str, params: dict[str, str] | None = None) -> object:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query at now; the result vector (or scalar, as a one-element list)."""
        data = self._get("/api/v1/query", {"query": expr})
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def value(self, expr: str) -> float | None:
        """The value of a query expected to return at most one series; None when it returns none."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def label_values(self, label: str, match: str) -> list[str]:
        return self._get(f"/api/v1/label/{label}/values", {"match[]": match})


def _config(targets: list[str], scrape_interval: str) -> str:
    # As in deploy/: no honor_labels, the series name their job in `undying_job`.
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  scrape_timeout: {scrape_interval}\n"
        "scrape_configs:\n"
        "  - job_name: undying\n"
        f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
    )


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"prometheus at {url} not ready in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def start_prometheus(tmp_path_factory) -> Iterator[Callable[..., Prometheus]]:
    """`start_prometheus(["127.0.0.1:PORT"])` -> a ready server scraping those targets every second."""
    if not PROMETHEUS.exists():
        pytest.fail(f"{PROMETHEUS} is missing: run `make servers` (scripts/install-servers.sh)")
    started: list[subprocess.Popen] = []

    def start(targets: list[str], scrape_interval: str = "1s") -> Prometheus:
        tmp = tmp_path_factory.mktemp("prometheus")
        (tmp / "prometheus.yml").write_text(_config(targets, scrape_interval))
        url = f"http://127.0.0.1:{_free_port()}"
        log = tmp / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(PROMETHEUS), f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address={url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT)
        started.append(proc)
        _wait_ready(url, proc, log)
        return Prometheus(url, proc, log)

    yield start
    for proc in started:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
