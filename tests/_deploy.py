"""Reading what deploy/ and the Dockerfiles say, for the tests that hold them to each other and to
the package: the image's name and tag, the Dockerfiles' instructions, the manifests, and the
Kubernetes and Docker size notations.

Shared by tests/unit/test_deploy_image.py, test_deploy_kuberay.py and test_deploy_ray.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import entry_points, metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILES = (ROOT / "Dockerfile", ROOT / "Dockerfile.cpu")
# Where the images are published (Makefile's IMAGE, deploy/README.md); tagged VERSION-gpu / -cpu.
IMAGE = "ghcr.io/undying-project/undying"


# The package as installed from pyproject.toml (editable, by `make setup`, which reinstalls when
# pyproject.toml changes): what pip sees when it builds the image.
def version() -> str:
    return metadata("undying")["Version"]


def extras() -> set[str]:
    return set(metadata("undying").get_all("Provides-Extra") or [])


def requirement(name: str) -> str:
    """The package's requirement on `name`, e.g. "torch>=2.13.0"."""
    [found] = [r for r in metadata("undying").get_all("Requires-Dist")
               if re.match(rf"{re.escape(name)}(\[|[<>=!~ ]|$)", r) and "extra ==" not in r]
    return found


def console_scripts() -> dict[str, str]:
    """Console script name -> "module:function", for undying's own scripts."""
    return {e.name: e.value for e in entry_points(group="console_scripts") if e.dist and e.dist.name == "undying"}


def gpu_image() -> str:
    return f"{IMAGE}:{version()}-gpu"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, USER, ...
    args: str  # continuation lines joined with single spaces
    line: int  # where it starts, 1-based


def instructions(path: Path) -> list[Instruction]:
    """The Dockerfile's instructions, comments and blank lines left out and `\\` continuations joined."""
    found: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continued instruction
            continue
        start = start if pending else number
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, args = " ".join(pending).partition(" ")
            found.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    assert not pending, f"{path.name}: the file ends inside a continued instruction"
    return found


def build_args(path: Path) -> dict[str, str]:
    """ARG NAME=default, for every ARG with a default."""
    return dict(i.args.split("=", 1) for i in instructions(path) if i.keyword == "ARG" and "=" in i.args)


def yaml_documents(relative: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / relative).read_text()) if doc is not None]


_KUBERNETES_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                     "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def kubernetes_bytes(quantity: str | int) -> int:
    """Bytes in a Kubernetes memory quantity ("8Gi", "900Gi", "34359738368")."""
    match = re.fullmatch(r"(\d+)([kMGT]i?|Ki)?", str(quantity))
    assert match, f"not a memory quantity these tests read: {quantity!r}"
    return int(match[1]) * _KUBERNETES_UNITS[match[2] or ""]


def docker_bytes(size: str) -> int:
    """Bytes in a Docker size ("8g", "64g": binary units, as `docker run --shm-size` reads them)."""
    match = re.fullmatch(r"(\d+)([bkmg]?)", size.lower())
    assert match, f"not a Docker size: {size!r}"
    return int(match[1]) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match[2]]
