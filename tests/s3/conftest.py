"""Fixtures of the `s3` tests: one real SeaweedFS S3 server per session (tests/s3/_seaweed.py),
and a `backend` fixture that runs the same checkpoint tests on file://, memory:// and s3://.

Each test gets its own prefix (`s3://undying/<uuid>/job`), so tests never see each other's
objects and the server needs no cleaning between them."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import pytest

from tests.s3._seaweed import BUCKET, SeaweedS3, ServerFailed, start_seaweed


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[SeaweedS3]:
    # Start-up takes about 2 s, also with both cores of a 2-core machine busy (measured
    # at load average 8.7: 2.6 s); the generous limit is for a machine swapping or worse.
    started = time.monotonic()
    try:
        server = start_seaweed(tmp_path_factory.mktemp("seaweedfs"), timeout_s=120.0)
    except ServerFailed as err:
        pytest.fail(f"cannot start the SeaweedFS S3 server: {err}")
    print(f"\nseaweedfs: S3 at {server.endpoint} ready in {server.started_in_s:.2f} s "
          f"(attempt {server.attempts}, {time.monotonic() - started:.2f} s in the fixture)")
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Backend:
    """A fresh, empty checkpoint root on one kind of storage."""

    kind: str  # "file", "memory" or "s3"
    url: str
    storage_options: dict = field(default_factory=dict)
    server: SeaweedS3 | None = None

    def cli_options(self) -> list[str]:
        """The arguments that reach this backend from `undying ckpt`."""
        return cli_options(self.storage_options)


_OPTION_FILES: list[str] = []  # written by cli_options, removed when the session ends


def cli_options(options: dict) -> list[str]:
    """`--storage-options-file` naming a new private file of `options` (credentials are refused as
    `--storage-option` flags), or nothing when there are no options. The file holds the test
    server's keys: it is removed when the test session ends."""
    if not options:
        return []
    fd, path = tempfile.mkstemp(prefix="undying-s3-options-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(options, f)
    _OPTION_FILES.append(path)
    return ["--storage-options-file", path]


@pytest.fixture(scope="session", autouse=True)
def _remove_option_files() -> Iterator[None]:
    yield
    for path in _OPTION_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _s3_backend(server: SeaweedS3) -> Backend:
    return Backend("s3", f"s3://{BUCKET}/{uuid.uuid4().hex}/job", server.storage_options, server)


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request, tmp_path) -> Iterator[Backend]:
    if request.param == "file":
        yield Backend("file", f"file://{tmp_path}/ckpt/job")
    elif request.param == "memory":
        # memory:// is one store per process: a unique root keeps tests apart, and it is
        # removed afterwards so the process does not accumulate checkpoints.
        root = f"undying-test-{uuid.uuid4().hex}"
        yield Backend("memory", f"memory://{root}/job")
        fs = fsspec.filesystem("memory")
        with contextlib.suppress(FileNotFoundError):
            fs.rm(f"/{root}", recursive=True)
    else:
        yield _s3_backend(request.getfixturevalue("s3_server"))


@pytest.fixture
def s3_backend(s3_server) -> Backend:
    return _s3_backend(s3_server)
