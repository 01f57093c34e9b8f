"""What marks a folder as a job's checkpoint root: step-<9 digits> folders, or an `owner/` folder of
lease claims (a folder named owner alone, a user's home say, is not one).

Called by the checks that keep other files out of a checkpoint root, whose retention and garbage
collection own everything under it: the spec's storage probe (a `checkpoint.url` that is a root
or inside one) and the CLI's output paths (`--out`, `--report` inside a local root). Each passes the
listing of its own store; a listing that raises propagates, and the caller decides what it means.
"""

from __future__ import annotations

from collections.abc import Callable

from ckpt.manifest import parse_step_dir
from ckpt.owner_claims import OWNER_DIR


def is_job_root(listdir: Callable[[str], list[str]], folder: str) -> bool:
    """`folder` (a path `listdir` takes) holds step folders or lease claims."""
    names = listdir(folder)
    if any(parse_step_dir(name) is not None for name in names):
        return True
    return OWNER_DIR in names and any(name.startswith("claim-")
                                      for name in listdir(f"{folder.rstrip('/')}/{OWNER_DIR}"))
