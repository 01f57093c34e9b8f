"""Local files a command writes when it ends (`--report`, `--timeline`, `--out`, `--plot`), checked
before it starts anything: a path that names a directory, or a place this user cannot write,
would otherwise fail after a run of hours, its files unwritten; a path inside a checkpoint root
could replace a checkpoint's file (retention and garbage collection own everything there). Their
parent directories are created when written, so a missing one is fine where it can be made.

Protocol: a command calls `output_problems({flag: path})` with the flags it was given, after the
spec is loaded and before it connects to Ray; each Problem names the flag and the fix (exit 2).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from orchestrator.spec.problems import Problem


def checkpoint_root_above(out: str) -> str | None:
    """The nearest folder above the local path `out` that is a checkpoint root (it holds step-<9 digits>
    directories or owner/ lease claims), any job's, one read through another URL (a mount) too."""
    from ckpt.root_marks import is_job_root

    folder = os.path.dirname(out)
    while True:
        with contextlib.suppress(OSError):
            if is_job_root(os.listdir, folder):
                return folder
        if os.path.dirname(folder) == folder:
            return None
        folder = os.path.dirname(folder)


def _problem(path: str) -> str | None:
    try:
        return _writable_problem(path)
    except OSError as err:  # a parent this user cannot enter: Path.exists and is_dir raise EACCES
        return f"{path} cannot be reached by this user ({err.strerror}); choose a writable place"


def _writable_problem(path: str) -> str | None:
    target = Path(path).expanduser()
    root = checkpoint_root_above(os.path.realpath(target))
    if root is not None:
        return f"{path} is inside the checkpoint folder {root}, whose files retention and garbage collection own; " \
               "write it outside"
    if target.is_dir():
        return f"{path} is a directory; give a file path"
    existing = next(p for p in (target.parent.absolute(), *target.parent.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, so {path} cannot be created; choose another path"
    if not os.access(existing, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return f"{path} cannot be written by this user; choose a writable place"
    return None


def output_problems(flags: dict[str, str | None]) -> list[Problem]:
    """One problem per output flag given (a path, not None) whose file could not be written."""
    return [Problem(flag, words) for flag, path in flags.items() if path and (words := _problem(path))]
