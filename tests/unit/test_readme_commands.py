"""The README's commands: every one is classified (tests/_readme.py), and the quick ones run here."""

from __future__ import annotations

import json

import pytest

from tests._readme import COVERED, END_TO_END, FAST, ROOT, check, readme_commands, run_command, scratch


def test_every_readme_command_is_checked_somewhere():
    commands = readme_commands()
    assert len(commands) >= 20
    tables = (FAST, END_TO_END, COVERED)
    unclassified = [c for c in commands if sum(c in table for table in tables) != 1]
    assert not unclassified, "README commands in no table of tests/_readme.py (or in two):\n" + "\n".join(unclassified)
    stale = [c for table in tables for c in table if c not in commands]
    assert not stale, "commands of tests/_readme.py no longer in the README:\n" + "\n".join(stale)


def test_covered_commands_name_a_test_that_runs_the_same_thing():
    for command, (path, text) in COVERED.items():
        assert text in (ROOT / path).read_text(), f"{command}: {path} does not contain {text!r}"


def test_the_parser_joins_continuations_and_drops_comments_outside_quotes():
    text = "```bash\nrun a \\\n  b   # note\necho '# kept' # dropped\n```\n```yaml\nnot: a command\n```\n"
    assert readme_commands(text) == ["run a b", "echo '# kept'"]


@pytest.mark.parametrize("command", list(FAST))
def test_quick_readme_command_runs(command, tmp_path):
    cwd = scratch(tmp_path / "checkout")
    proc = run_command(command, cwd, timeout=120)
    check(command, proc, FAST[command])
    if "--json" in command or "json.tool" in command:
        json.loads(proc.stdout)
