"""The test process's exit: its verdict, then no interpreter teardown.

Hundreds of tests build writers, housekeepers, loaders and stores in this process and leave their
daemon threads parked (a checkpoint writer waiting for its next save, a commit lane for its next
create), and importing Ray starts OpenTelemetry exporter threads here; the interpreter's teardown
then frees modules under those threads. That teardown is not what the suite tests, and a crash in
it (SIGSEGV after every test passed) would turn a passing suite red. So once pytest has reported,
the process ends with the session's exit status and without the teardown (`os._exit`, as after a
fork). The product's own processes exit normally, and the tests that run them (drivers, `undying`
commands) check their exit codes.

A crash before that point still shows its stacks: `make test` runs pytest with Python's fault
handler on, which pytest leaves enabled after its own.
"""

from __future__ import annotations

import os
import sys

import pytest

_SESSION = pytest.StashKey[pytest.Session]()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.stash.get(_SESSION, None)
    if session is None:  # no session ran (a usage error, --help): pytest's own exit path
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))  # as pytest.main would return it, after every sessionfinish
