"""The README's end-to-end commands, run in README order as a new user would run them (heavy: they
train the demo, a chaos experiment and sweep, the fine-tune, about 20 minutes on 2 cores).

    .venv/bin/python -m pytest -m heavy tests/ray/test_readme_commands.py -s

Each command runs in one scratch directory that behaves like a checkout (tests/_readme.py), on its
own embedded local Ray (no RAY_ADDRESS), so it sees what a user sees after `make demo`.
"""

from __future__ import annotations

import os

import pytest

from tests._readme import END_TO_END, ROOT, check, readme_commands, run_command, scratch

pytestmark = [pytest.mark.ray, pytest.mark.heavy, pytest.mark.timeout(3600)]


def test_readme_commands_run_in_order(tmp_path, monkeypatch):
    assert (ROOT / ".venv" / ".installed-stamp").exists(), "run `make setup` first"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cwd = scratch(tmp_path / "checkout")
    ordered = [c for c in readme_commands() if c in END_TO_END]
    assert len(ordered) == len(END_TO_END)
    for command in ordered:
        proc = run_command(command, cwd, timeout=1200)
        check(command, proc, END_TO_END[command])
        print(f"ok: {command}", flush=True)
    assert (cwd / "runs" / "demo" / "timeline.png").stat().st_size > 0
    assert (cwd / "model.safetensors").stat().st_size > 0 and (cwd / "sweep.png").stat().st_size > 0
    assert os.path.isdir(cwd / "runs" / "finetune" / "exported")
