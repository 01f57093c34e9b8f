"""`promtool check metrics` (Prometheus' own linter of the exposition format and its naming
conventions, from the package `make servers` installs) on a scraped exposition text."""

from __future__ import annotations

import os
import subprocess
import urllib.request

import pytest

PROMTOOL = "/usr/bin/promtool"
# No proxy, whatever the environment says: the tests speak to loopback only.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def scrape(url: str) -> str:
    with _OPENER.open(url, timeout=10) as response:
        return response.read().decode()


def lint(exposition: str) -> str:
    """What promtool reports about `exposition`: "" when it passes without a warning."""
    if not os.path.exists(PROMTOOL):
        pytest.fail(f"{PROMTOOL} is missing: run `make servers` (scripts/install-servers.sh)")
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True,
                           timeout=60)
    report = (check.stdout + check.stderr).strip()
    # Lint problems exit 3 with one line each; a clean text exits 0 and prints nothing.
    return report or ("" if check.returncode == 0 else f"promtool exited {check.returncode}")
