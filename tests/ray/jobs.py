"""Running `undying run` against the test cluster, shared by the ray tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ckpt.owner_claims import OWNER_DIR

ROOT = Path(__file__).resolve().parents[2]
UNDYING = str(Path(sys.executable).parent / "undying")

# The tiny job every ray test runs: 4 ranks, 40 steps, a checkpoint every 10. Each rank asks
# for one of the custom `undying_slot` resources the test cluster's worker nodes offer. No warm
# spare unless a test asks for one (the default, auto, would start a fifth actor in every job),
# and no memory level unless a test asks for it: a failure here rolls back to the newest storage
# checkpoint, the path these tests pin down (the memory level's own tests switch it on).
BASE = [
    "train.steps=40", "checkpoint.every_steps=10", "checkpoint.keep=2", "parallel.dp=4",
    "train.global_batch=16", "train.micro_batch=2", "resources.custom={undying_slot: 1}", "elastic.spares=0",
    "checkpoint.memory.enabled=false",
]


def run_job(ray_cluster: str, tmp: Path, name: str, extra: list[str], timeout: float = 300):
    """Run the demo job with overrides; returns (completed process, report path). The process carries
    `wall_s`, the run as timed from outside (the clock a report's goodput is checked against)."""
    report = tmp / f"{name}.json"
    sets = [*BASE, f"name={name}", f"checkpoint.url=file://{tmp}/ckpt", *extra]
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(report), "--address", ray_cluster]
    for item in sets:
        cmd += ["--set", item]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    proc.wall_s = time.monotonic() - started
    return proc, report


def goodput_checks(report: dict, measured_wall_s: float) -> list:
    """The report's goodput against clocks, never against its own sum (its goodput.wall_s is that sum):
    the buckets add up to the ledger's clock wall, which fits inside the run as timed from outside."""
    from orchestrator.cli.chaos.experiment import check_wall_within
    from orchestrator.cli.chaos.invariants import check_goodput

    goodput = report["goodput"]
    buckets = {"productive": goodput["productive_s"], **goodput["badput_s"]}
    return [check_goodput(buckets, wall_s=goodput["clock_wall_s"]),
            check_wall_within(goodput["clock_wall_s"], measured_wall_s)]


def start_job(address: str, tmp: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    """Start the demo job in the background; returns (process, report path, log path)."""
    report, log = tmp / f"{name}.json", tmp / f"{name}.log"
    cmd = [UNDYING, "run", str(ROOT / "examples/demo.yaml"), "--report", str(report), "--address", address]
    for item in [*BASE, f"name={name}", f"checkpoint.url=file://{tmp}/ckpt", *extra]:
        cmd += ["--set", item]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    return proc, report, log


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Until `text` shows in the job's log (the job must still be running)."""
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def finish_job(proc: subprocess.Popen, report: Path, log: Path) -> dict:
    """Wait for a job started with `start_job` to succeed; its report."""
    assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
    return json.loads(report.read_text())


# The chaos invariant checks `undying chaos` prints, in order (orchestrator.cli.chaos.invariants).
CHECKS = ("checkpoints_verify", "newest_loads", "model_matches_reference", "data_exactly_once",
          "goodput_sums_to_wall", "no_process_left", "faults_fired", "goodput_wall_plausible")


def chaos_job(ray_cluster: str, tmp: Path, name: str, flags: list[str], sets: list[str], timeout: float):
    """`undying chaos` on the demo job (the failure-free reference run first, then the faulty one);
    returns (completed process, report path)."""
    report = tmp / f"{name}.json"
    # The timeline goes beside the report: its default is the working directory, here the checkout.
    cmd = [UNDYING, "chaos", str(ROOT / "examples/demo.yaml"), "--address", ray_cluster, "--report", str(report),
           "--timeline", str(tmp / f"{name}-timeline.png"), *flags]
    for item in [*BASE, f"name={name}", f"checkpoint.url=file://{tmp}/ckpt", "chaos.faults=[]", *sets]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc, report


def assert_every_check_passed(proc, report_path: Path) -> dict:
    """The chaos run succeeded and every invariant passed; its report."""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("invariants:"):]
    for name in CHECKS:
        assert f"PASS  {name}" in table, table
    assert "FAIL" not in table and "every check passed" in proc.stdout
    report = json.loads(report_path.read_text())
    assert report["invariants"]["ok"] is True and report["status"] == "succeeded"
    assert [c["name"] for c in report["invariants"]["checks"]] == list(CHECKS)
    return report


def claim_from_elsewhere(storage, epoch: int, job: str, lease_s: float = 3.0) -> float:
    """What a driver of `job` on another host (node-9) writes to own its checkpoint root, or when it
    judged the owner dead: a claim and one beat (ckpt.ownership). Returns the beat's time."""
    now = time.time()
    record = {"holder": f"undying run of job {job!r}", "lease_s": lease_s, "claimed_at": now,
              "process": {"host": "node-9/boot/pid:[1]", "pid": 777, "started": "1"}, "taken_because": "test"}
    storage.create_exclusive(storage.path(OWNER_DIR, f"claim-{epoch:010d}.json"), json.dumps(record).encode())
    storage.write_immutable(storage.path(OWNER_DIR, f"beat-{epoch:010d}.json"),
                            json.dumps({"beat": 1, "time": now, "ended": False}).encode())
    return now
