"""A private local Ray head for bench.recovery (and bench.goodput): free ports, its own temp dir, stopped by PID.

undying and Ray Train both run on it, so neither system's wall time includes starting Ray.
The head's environment is inherited by every Ray worker process: it puts the repository on
PYTHONPATH (Ray Train imports the benchmark's training function, `bench.*.worker`, by reference),
keeps gloo on loopback and sets Ray Train's health-check interval. Never `ray stop`: that
kills every Ray process on the machine, including other people's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the head (and so every Ray worker) and for the bench's drivers."""
    env = dict(os.environ if base is None else base)
    # The repository, so that every process (Ray's workers too) imports the `bench` package.
    paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update({
        "PYTHONPATH": os.pathsep.join(paths),
        "GLOO_SOCKET_IFNAME": "lo",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "RAY_AUTH_MODE": "disabled",  # a private cluster: no token to hand around
        "RAY_DEDUP_LOGS": "0",
    })
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayHead:
    address: str
    temp_dir: str
    proc: subprocess.Popen

    def stop(self) -> None:
        """SIGTERM the `ray start --block` process group, then SIGKILL what is left of its session."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for entry in os.listdir("/proc"):  # Ray workers make their own process groups, same session
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) == self.proc.pid:
                        os.kill(int(entry), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue


def start_head(num_cpus: int, timeout_s: float = 120.0) -> RayHead:
    temp_dir = tempfile.mkdtemp(prefix="rbench-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = free_port()
    ports = {flag: free_port() for flag in ("ray-client-server-port", "node-manager-port", "object-manager-port",
                                            "dashboard-agent-listen-port", "metrics-export-port",
                                            "runtime-env-agent-port")}
    log = open(os.path.join(temp_dir, "ray-start.log"), "wb")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
         "--num-gpus=0", f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
         *(f"--{flag}={value}" for flag, value in ports.items())],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=worker_env(),
    )
    log.close()
    head = RayHead(f"127.0.0.1:{port}", temp_dir, proc)
    probe = [str(VENV_BIN / "python"), "-c",
             f"import ray; ray.init(address={head.address!r}, logging_level='ERROR'); "
             "assert ray.cluster_resources().get('CPU', 0) > 0"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}; see {temp_dir}/ray-start.log")
        if subprocess.run(probe, capture_output=True, timeout=90, env=worker_env()).returncode == 0:
            return head
        time.sleep(1.0)
    head.stop()
    raise TimeoutError(f"the local Ray head did not come up in {timeout_s:.0f} s; see {temp_dir}/ray-start.log")
