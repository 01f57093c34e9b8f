"""The control plane of a real local `undying run`: its driver listens on no more wildcard
sockets than a bare `ray.init()` driver (the store and the metrics endpoint are on loopback),
and a process that writes to the store without the job's secret changes nothing: the keys it
can guess are not the job's (their names derive from the secret), so nothing of it is even
read. A writer that knows the names but not the secret is dropped and counted: see
tests/unit/test_control_auth.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests._sockets import listening_sockets, wildcard
from tests.ray.jobs import ROOT, UNDYING

pytestmark = [pytest.mark.ray, pytest.mark.heavy]

BARE_DRIVER = """
import json, ray
from tests._sockets import listening_sockets
ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, logging_level="ERROR")
print(json.dumps(sorted(listening_sockets())))
ray.shutdown()
"""

FORGER = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
for gen in range(3):
    store.set(f"gen{gen}/abort", "1")
    store.set(f"gen{gen}/hb/0", json.dumps({"step": 0, "time": 0.0, "compute_s": 99.0}))
    store.queue_push(f"gen{gen}/events", json.dumps({"type": "node_lost", "node": "x", "rank": 0, "time": 0.0}))
store.check(["round-trip"])
"""


def _bare_driver_sockets() -> set[tuple[str, int]]:
    out = subprocess.run([sys.executable, "-c", BARE_DRIVER], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=True).stdout
    return {tuple(s) for s in json.loads(out.strip().splitlines()[-1])}


def _parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("undying_control_messages_rejected_total{"):
            channel = re.search(r'channel="(\w+)"', line)[1]
            out[channel] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_local_job_listens_on_loopback_and_a_forger_changes_nothing(tmp_path):
    bare = _bare_driver_sockets()
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(tmp_path / "report.json"),
           "--set", "chaos.faults=[]", "--set", "parallel.dp=2", "--set", "train.steps=40", "--set", "elastic.spares=0",
           "--set", f"checkpoint.url=file://{tmp_path}/ckpt"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)  # never a full pipe
    reader.start()
    try:
        metrics_url, metrics_port = _metrics_endpoint(lines)
        store_port = _store_port(job.pid, metrics_port, len(bare) + 2)
        driver = listening_sockets(job.pid)
        subprocess.run([sys.executable, "-c", FORGER, str(store_port)], check=True, timeout=60)
        rejected = _watch_rejections(metrics_url, job)
        assert job.wait(timeout=300) == 0, "".join(lines)
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    assert ("127.0.0.1", store_port) in driver and ("127.0.0.1", metrics_port) in driver
    assert len(wildcard(driver)) == len(wildcard(bare)) == 1, (driver, bare)  # Ray's own, nothing of ours
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "succeeded" and report["failures"] == [] and report["final_step"] == 40, out
    assert not any(rejected.values()) and "dropped a message" not in out, (rejected, out)


def _metrics_endpoint(lines: list[str], timeout_s: float = 120.0) -> tuple[str, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := re.search(r"metrics at (http://127\.0\.0\.1:(\d+)/metrics)", line):
                return match[1], int(match[2])
        time.sleep(0.1)
    raise TimeoutError("the job never printed its metrics endpoint:\n" + "".join(lines))


def _store_port(pid: int, metrics_port: int, expected: int, timeout_s: float = 120.0) -> int:
    """The control store's port: once the driver listens on `expected` sockets (a bare driver's,
    the metrics endpoint's and the store's), its loopback listener other than the metrics'."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sockets = listening_sockets(pid)
        if len(sockets) >= expected:
            ports = {port for ip, port in sockets if ip == "127.0.0.1"} - {metrics_port}
            assert len(ports) == 1, f"the store is not on loopback: the driver listens on {sorted(sockets)}"
            return ports.pop()
        time.sleep(0.1)
    raise TimeoutError(f"the driver never listened on {expected} sockets")


def _watch_rejections(metrics_url: str, job: subprocess.Popen) -> dict[str, float]:
    """The rejection counts last scraped before the job ends (its endpoint closes with it)."""
    seen: dict[str, float] = {}
    while job.poll() is None and not (seen.get("abort") and seen.get("events")):
        try:
            seen = _parse(urllib.request.urlopen(metrics_url, timeout=5).read().decode())
        except OSError:
            break  # the job ended between the poll and the scrape
        time.sleep(0.2)
    return seen

