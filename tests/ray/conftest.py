"""A real local Ray cluster for the `ray` tests: started here, on free ports, in its own temp
dir, and stopped by the PID (process group) of the `ray start --block` process we launched.
Never `ray stop`: that would hit every Ray process on the machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.ray._multinode import LocalCluster
from tests.ray.jobs import run_job

VENV_BIN = Path(sys.executable).parent


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports (held open together while chosen, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port() -> int:
    return _free_ports(1)[0]


def _wait_for_cluster(address: str, proc: subprocess.Popen, timeout_s: float = 90.0, min_cpus: int = 1) -> None:
    deadline = time.monotonic() + timeout_s
    probe = [str(VENV_BIN / "python"), "-c",
             f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
             f"assert ray.cluster_resources().get('CPU', 0) >= {min_cpus}"]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass  # the head is still starting (a slow machine): ask again
        time.sleep(1.0)
    raise TimeoutError(f"local Ray cluster at {address} did not come up in {timeout_s:.0f} s")


def _kill_session(sid: int) -> None:
    """SIGKILL every process of the session `ray start` led (Ray workers make their own
    process groups but stay in the session), found by PID through /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                os.kill(int(entry), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


@pytest.fixture(scope="session")
def local_cluster():
    """A local multi-node Ray cluster: a head without CPUs (the controller's node) and three
    worker nodes of 2 logical CPUs each (ranks share the machine's cores)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private test cluster: no token to distribute
    cluster = LocalCluster(nodes=3, cpus_per_node=2)
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(local_cluster):
    """Address of the multi-node cluster the failure tests run their jobs on."""
    return local_cluster.address


@pytest.fixture(scope="module")
def ray_head():
    """Address of a local Ray head started with `ray start --head` (dashboard on), 8 logical CPUs."""
    # A private test cluster on this machine: no token to distribute to the CLI under test.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port, dashboard_port, *p = _free_ports(9)
    log = open(os.path.join(temp_dir, "ray-start.log"), "wb")  # noqa: SIM115 (closed in finally)
    # Job entrypoints run with the cluster's environment: put this venv's tools on its PATH.
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=8",
         "--num-gpus=0", f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard_port}", "--disable-usage-stats",
         f"--ray-client-server-port={p[0]}", f"--node-manager-port={p[1]}",
         f"--object-manager-port={p[2]}", f"--dashboard-agent-listen-port={p[3]}",
         f"--dashboard-agent-grpc-port={p[4]}",
         f"--metrics-export-port={p[5]}", f"--runtime-env-agent-port={p[6]}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )
    os.environ["UNDYING_TEST_DASHBOARD"] = f"http://127.0.0.1:{dashboard_port}"
    address = None
    try:
        node_ip = subprocess.run(
            [str(VENV_BIN / "python"), "-c", "import ray._private.services as s; print(s.get_node_ip_address())"],
            capture_output=True, text=True, check=True).stdout.strip()
        address = f"{node_ip}:{port}"
        _wait_for_cluster(address, proc)
        yield address
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_session(proc.pid)
        log.close()


@pytest.fixture(scope="session")
def reference(ray_cluster, tmp_path_factory):
    """The failure-free run (as its JSON report) that every faulty run must reproduce."""
    import json

    tmp = tmp_path_factory.mktemp("reference")
    # TensorBoard on: tests/ray/test_tracking_run.py reads its event files (telemetry only: the run is the same)
    proc, report = run_job(ray_cluster, tmp, "ref", ["chaos.faults=[]", f"monitor.tensorboard={tmp}/tb"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {**json.loads(report.read_text()), "checkpoint_dir": str(tmp / "ckpt" / "ref"),
            "tensorboard_dir": str(tmp / "tb"), "measured_wall_s": proc.wall_s}
