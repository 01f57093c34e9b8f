"""Optional packages a command will need, checked before it starts anything.

The core install leaves out what only some runs use: matplotlib for the PNGs (`undying run
--timeline`, the timeline `undying chaos` writes, `chaos sweep --plot`), tensorboard and wandb for
`monitor.tensorboard` / `monitor.wandb` (monitor.tracking.tracking_problems names those). A
missing one is found here, before Ray or any rank starts, as a `Problem` naming the flag and the
pip extra that installs it (exit 2), never as a traceback after the whole run.

Protocol: a command calls `plot_problems({flag: path})` with the PNG flags it was given, after
the spec is loaded and before it connects to Ray.
"""

from __future__ import annotations

import importlib.util
import sys

from orchestrator.spec.problems import Problem

PLOT_MODULE, PLOT_EXTRA = "matplotlib", "plot"


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (a None entry in sys.modules,
    the standard way to block an import, counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def install_hint(extra: str) -> str:
    return f"pip install 'undying[{extra}]'"


def plot_problems(flags: dict[str, str | None]) -> list[Problem]:
    """One problem per PNG flag given (a path, not None) when matplotlib is missing."""
    if installed(PLOT_MODULE):
        return []
    return [Problem(flag, f"writing {path} needs matplotlib, which is not installed: {install_hint(PLOT_EXTRA)}, "
                          f"or leave out {flag}") for flag, path in flags.items() if path]
