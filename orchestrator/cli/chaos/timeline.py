"""The timeline PNG `undying chaos` writes of its faulty run.

Protocol: orchestrator.cli.chaos.command calls `timeline_path(spec, flag)` before the faulty run
(a given `--timeline` has been checked for matplotlib with the other usage problems; without
one, the default path is used when matplotlib is installed, else a line says how to get the PNG)
and `write_timeline(report, path, faults)` after the invariant checks, which renders
monitor.timeline (every fault, its detection and the return to training marked) and prints
the path.
"""

from __future__ import annotations

import os

from orchestrator.cli.extras import PLOT_EXTRA, PLOT_MODULE, install_hint, installed


def default_path(spec) -> str:
    return f"{spec.name}-chaos-timeline.png"


def timeline_path(spec, flag: str | None) -> str | None:
    """Where the faulty run's timeline goes: `--timeline`, else the default when matplotlib is here."""
    if flag:
        return flag
    if installed(PLOT_MODULE):
        return default_path(spec)
    print(f"undying chaos: no timeline PNG of this run: matplotlib is not installed ({install_hint(PLOT_EXTRA)})",
          flush=True)
    return None


def write_timeline(report, path: str, faults: str) -> None:
    from monitor.timeline import plot_timeline

    plot_timeline(report, path, title=f"undying chaos: {faults}")
    print(f"timeline (faults, detections, recoveries) written to {os.path.abspath(path)}", flush=True)
