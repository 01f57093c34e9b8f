"""Running `undying run` against the test cluster, shared by the ray tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNDYING = str(Path(sys.executable).parent / "undying")

# The tiny job every ray test runs: 4 ranks, 40 steps, a checkpoint every 10. Each rank asks
# for one of the custom `undying_slot` resources the test cluster's worker nodes offer.
BASE = [
    "train.steps=40", "checkpoint.every_steps=10", "checkpoint.keep=2", "parallel.dp=4",
    "train.global_batch=16", "train.micro_batch=2", "resources.custom={undying_slot: 1}",
]


def run_job(ray_cluster: str, tmp: Path, name: str, extra: list[str], timeout: float = 300):
    """Run the demo job with overrides; returns (completed process, report path)."""
    report = tmp / f"{name}.json"
    sets = [*BASE, f"name={name}", f"checkpoint.url=file://{tmp}/ckpt", *extra]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(report), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, report
