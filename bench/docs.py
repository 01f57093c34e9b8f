"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone."""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from pathlib import Path

HEADER = "# Benchmarks\n\nMeasured figures; each section says how to reproduce it.\n"


def replace_section(path: Path, heading: str, text_of_section: str, notes: tuple[str, str]) -> None:
    """Replace only the section under `heading` (up to the next `## ` heading), re-reading the
    file right before. Hand-written notes between the `notes` markers inside the old section
    are carried over."""
    text = path.read_text() if path.exists() else HEADER
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + text_of_section
    else:
        end = text.find("\n## ", start + len(heading))
        old = text[start:end if end >= 0 else len(text)]
        if notes[0] in old and notes[1] in old:
            kept = old[old.index(notes[0]):old.index(notes[1]) + len(notes[1])]
            text_of_section = text_of_section.rstrip("\n") + "\n\n" + kept + "\n"
        rest = text[end + 1:] if end >= 0 else ""
        text = text[:start] + text_of_section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    path.write_text(text)


def write_section(path: Path, heading: str, text_of_section: str, notes: tuple[str, str]) -> None:
    """`replace_section`, and an empty notes block the first time, so that hand-written notes
    have a place that survives the next run."""
    if notes[0] not in (path.read_text() if path.exists() else ""):
        text_of_section = text_of_section.rstrip("\n") + f"\n\n{notes[0]}\n{notes[1]}\n"
    replace_section(path, heading, text_of_section, notes)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def median_max(values: list[float]) -> str:
    """ "median (max)" in milliseconds, or "-" for no values."""
    return f"{ms(statistics.median(values))} ({ms(max(values))})" if values else "-"


def run_facts(module: str, argv: list[str] | None, load: float) -> dict:
    """What a section says of its run: the command that reproduces it (`module`'s, with `argv`, else
    this process's arguments), when (UTC) and the 1-minute load average before it (`load`)."""
    args = argv if argv is not None else sys.argv[1:]
    return {"command": shlex.join([".venv/bin/python", "-m", module, *args]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": load}


def measured_by(module: str, result: dict) -> str:
    """A section's first lines: which command measured it, and when (`run_facts`)."""
    return f"Measured by `python -m {module}` on {result['date']}. Command:\n\n```bash\n{result['command']}\n```"


def publish(table: str, docs: str, heading: str, section: str, notes: tuple[str, str]) -> None:
    """Print a run's table, and write its section into the markdown file `docs` ('' : not at all)."""
    print(table)
    if docs:
        write_section(Path(docs), heading, section, notes)
        print(f"section {heading[3:]!r} written to {docs}")
