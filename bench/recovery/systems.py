"""Run one system once with the kill, and turn what it left behind into the benchmark's numbers.

Each `run_*` function starts the system as a child process in a fresh work directory, waits
for it, and returns one flat dict (see `measurement`). Times are wall-clock seconds on one
machine clock (`time.time()` in every process):

  detection_s          kill -> the system noticed (its first recorded reaction; see each run_*)
  kill_to_first_step_s kill -> the first training step completed after the restart
  steps_redone         steps completed before the kill that were computed again after it
  phases               kill_to_first_step_s split into detect, re-form, restore, first step
  wall_s               the whole run, launch to exit, as the bench's clock sees it

The kill itself is the same everywhere: rank 1 (by default) SIGKILLs itself after the
backward of step 25, the fault undying's spec describes (undying injects it; the Ray Train
and torchrun workers in bench/recovery/worker.py do it themselves).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.recovery.ray_head import ROOT, VENV_BIN, RayHead, free_port, worker_env

WORKER = "bench.recovery.worker"  # run as `python -m` (torchrun: `-m`) from the repository root
RUN_TIMEOUT_S = 900


def measurement(system: str, wall_s: float, kill_t: float, detect_t: float, reform_t: float,
                restored_t: float, first_step_t: float, steps_redone: int, final_loss: float, **extra) -> dict:
    """The flat record of one run; every phase is measured from the previous point in time."""
    return {
        "system": system, "wall_s": wall_s, "detection_s": detect_t - kill_t,
        "kill_to_first_step_s": first_step_t - kill_t, "steps_redone": steps_redone, "final_loss": final_loss,
        "phases": {"detect": detect_t - kill_t, "re-form": reform_t - detect_t,
                   "restore": restored_t - reform_t, "first step": first_step_t - restored_t},
        **extra,
    }


def launch(cmd: list[str], log_path: Path, env: dict[str, str]) -> float:
    """Run `cmd` to completion (its own session, so a timeout kills all of it); return wall seconds."""
    started = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{cmd[0]} ran past {RUN_TIMEOUT_S} s; see {log_path}") from None
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {code}; see {log_path}")
    return time.time() - started


def _worker_config(job: dict, workdir: Path, kill: bool, **extra) -> dict:
    (workdir / "ckpt").mkdir(parents=True, exist_ok=True)
    return {"spec": job["spec"], "overrides": job["overrides"], "events": str(workdir / "events.jsonl"),
            "ckpt_dir": str(workdir / "ckpt"), "marker": str(workdir / "killed"),
            "kill_rank": job["kill_rank"] if kill else -1, "kill_step": job["kill_step"],
            "every": job["every"], **extra}


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker_points(events: list[dict]) -> dict:
    """Kill, restart and first-step times from the events the Ray Train and torchrun workers wrote."""
    kill = next(e for e in events if e["ev"] == "kill")
    steps = [e for e in events if e["ev"] == "step"]
    before = [e["step"] for e in steps if e["attempt"] == 0]
    after = [e for e in steps if e["attempt"] > 0]
    restored = min((e for e in events if e["ev"] == "restored" and e["attempt"] > 0), key=lambda e: e["t"])
    starts = [e["t"] for e in events if e["ev"] == "start" and e["attempt"] > 0]
    return {"kill_t": kill["t"], "reform_t": min(starts), "restored_t": restored["t"],
            "first_step_t": min(e["t"] for e in after), "restored_step": restored["step"],
            "steps_redone": max(before) + 1 - restored["step"], "kill_step": kill["step"],
            "final_loss": max(steps, key=lambda e: (e["step"], e["t"]))["loss"]}


# ---- torchrun ------------------------------------------------------------------------------------

# glog-style prefix of torch's log lines: "I1130 11:56:10.842000 22206 path:line] message" (local time).
_GLOG = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) \d+ \S+\] (.*)$")
_TORCHRUN_REACTION = ("closing signal SIGTERM", "will restart worker group")


def torchrun_reaction_time(log_text: str, after_t: float) -> float:
    """When torchrun's agent first acted on the failure: it SIGTERMs the surviving workers as soon
    as its monitor (every 0.1 s) sees one exit, then logs that it restarts the group."""
    year = datetime.fromtimestamp(after_t).year
    for line in log_text.splitlines():
        match = _GLOG.match(line)
        if match and any(text in match.group(7) for text in _TORCHRUN_REACTION):
            month, day, hour, minute, second, micro = (int(g) for g in match.groups()[:6])
            at = datetime(year, month, day, hour, minute, second, micro).timestamp()
            if at >= after_t - 0.001:  # log times are rounded to the millisecond
                return at
    raise ValueError("torchrun's log has no sign of the restart (looked for: " + ", ".join(_TORCHRUN_REACTION) + ")")


def run_torchrun(job: dict, workdir: Path, kill: bool = True) -> dict:
    cfg = _worker_config(job, workdir, kill)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(job["world_size"]),
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", WORKER, "torchrun", "--config", json.dumps(cfg)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: without it the restarted group cannot form here.
    env = worker_env() | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    log = workdir / "torchrun.log"
    wall = launch(cmd, log, env)
    events = read_events(Path(cfg["events"]))
    if not kill:
        last = max((e for e in events if e["ev"] == "step"), key=lambda e: e["step"])
        return {"system": "torchrun (no failure)", "wall_s": wall, "final_loss": last["loss"], "log": str(log)}
    points = _worker_points(events)
    detect_t = torchrun_reaction_time(log.read_text(errors="replace"), points["kill_t"])
    return measurement("torchrun", wall, detect_t=detect_t, log=str(log), **points)


# ---- Ray Train -----------------------------------------------------------------------------------


_WG_INIT = re.compile(r"^\[Worker Group Initialization\] (.*) in ([\d.]+) ?s")


def raytrain_controller_log(head: RayHead, after_t: float) -> tuple[float, list[tuple[str, float]]]:
    """From Ray Train's controller log: when it decided to retry after `after_t` (its `[FailurePolicy]
    RETRY` line, local time, millisecond resolution, written right after the health check that saw
    the failure), and its own timing of the worker-group restart that followed."""
    records = []
    for path in (Path(head.temp_dir) / "session_latest" / "logs" / "train").glob("ray-train-sys-controller-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            at = datetime.strptime(record["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= after_t - 0.001:  # log times are rounded to the millisecond
                records.append((at, str(record.get("message", ""))))
    records.sort()
    decided = next((at for at, message in records if message.startswith("[FailurePolicy]")), None)
    if decided is None:
        raise ValueError(f"no [FailurePolicy] decision after the kill in {head.temp_dir}/session_latest/logs/train")
    restart = []
    for at, message in records:
        match = _WG_INIT.match(message)
        if at >= decided and match:
            restart.append((match.group(1), float(match.group(2))))
            if message.startswith("[Worker Group Initialization] Worker group startup completed"):
                break
    return decided, restart


def run_raytrain(job: dict, workdir: Path, head: RayHead) -> dict:
    cfg = _worker_config(job, workdir, kill=True, address=head.address, world_size=job["world_size"],
                         run_name=f"recovery-{workdir.name}", max_restarts=3)
    log = workdir / "raytrain.log"
    wall = launch([sys.executable, "-m", WORKER, "raytrain", "--config", json.dumps(cfg)], log, worker_env())
    events = read_events(Path(cfg["events"]))
    points = _worker_points(events)
    detect_t, restart = raytrain_controller_log(head, points["kill_t"])
    # Cross-check from Ray's own actor table: when the killed attempt's surviving workers ended.
    old = {e["pid"] for e in events if e["ev"] == "start" and e["attempt"] == 0}
    killed = next(e["pid"] for e in events if e["ev"] == "kill")
    ends = [e["end_ms"] / 1000 for e in events if e["ev"] == "ray_actor" and e["actor_pid"] in old - {killed}]
    torn_down = (min(ends) - points["kill_t"]) if ends else None
    return measurement("Ray Train", wall, detect_t=detect_t, log=str(log), survivors_ended_after_s=torn_down,
                       restart_log=restart, **points)


# ---- undying -------------------------------------------------------------------------------------

_TRANSITION = re.compile(r"^\[\s*([\d.]+)s\] (\w+) -> (\w+): (.*)$")


def undying_points(report: dict, stdout: str) -> dict:
    """undying's numbers from its report, and the phase split from its transition lines.

    The report's times are job seconds (one clock, the controller's); the fault time is the
    killed rank's own timestamp. Re-form ends when the new generation's process group is
    formed (RENDEZVOUS -> RESTORING), restore when the ranks resume (RESTORING -> RUNNING).
    """
    failure = report["failures"][0]
    fault = failure["time"] - failure["detected_after_s"]
    transitions = [(float(m.group(1)), m.group(2), m.group(3)) for line in stdout.splitlines()
                   if (m := _TRANSITION.match(line))]
    after = [(t, a, b) for t, a, b in transitions if t >= failure["time"] - 1e-6]
    formed = next(t for t, a, b in after if (a, b) == ("RENDEZVOUS", "RESTORING"))
    running = next(t for t, a, b in after if (a, b) == ("RESTORING", "RUNNING"))
    # The step the recovery resumed from: the history's second restore (the first is the start). It
    # may be a memory snapshot's step, which no storage checkpoint in the report records.
    restore_point = [entry[1] for entry in report["history"] if entry[0] == "restore"][1]
    return {"kill_t": fault, "detect_t": failure["time"], "reform_t": formed, "restored_t": running,
            "first_step_t": fault + failure["first_step_after_s"], "restored_step": restore_point,
            "steps_redone": failure["step"] + 1 - restore_point, "final_loss": report["final_loss"],
            "recovered_after_s": failure["recovered_after_s"], "restore_level": failure["restore_level"],
            "storage_read_bytes": failure["storage_read_bytes"], "lost_work_s": failure["lost_work_s"],
            "median_step_s": _median_step_s(report["losses"])}


def _median_step_s(losses: list[dict]) -> float:
    """Median seconds between consecutive completed steps (a memory interval in seconds is k of them)."""
    gaps = [b["time"] - a["time"] for a, b in zip(losses, losses[1:], strict=False) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else 0.0


def memory_every(stdout: str, job: dict, extra_sets: list[str]) -> int | None:
    """The memory level's cadence in steps at the kill: `every_steps` when fixed, else the last cadence the
    controller announced before the failure ("memory snapshots every N steps"); None when the level is off."""
    from orchestrator.spec.job_spec import load_spec

    memory = load_spec(job["spec"], [*job["overrides"], *extra_sets]).checkpoint.memory
    if not memory.enabled:
        return None
    if memory.every_steps is not None:
        return memory.every_steps
    before = stdout.split("RUNNING -> RECOVERING", 1)[0]
    found = re.findall(r"memory snapshots every (\d+) steps", before)
    return int(found[-1]) if found else None  # None: still probing (its first snapshot after 10 steps)


def run_undying(job: dict, workdir: Path, head: RayHead, extra_sets: list[str]) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    report_path, log = workdir / "report.json", workdir / "undying.log"
    sets = [f"checkpoint.url=file://{workdir / 'ckpt'}", *job["overrides"], *extra_sets]
    cmd = [str(VENV_BIN / "undying"), "run", job["spec"], "--address", head.address, "--report", str(report_path)]
    cmd += [arg for value in sets for arg in ("--set", value)]
    wall = launch(cmd, log, worker_env())
    stdout = log.read_text(errors="replace")
    points = undying_points(json.loads(report_path.read_text()), stdout)
    story = [line for line in stdout.splitlines() if re.match(r"^\[\s*[\d.]+s\] ", line)]
    return measurement("undying", wall, log=str(log), report=str(report_path), transitions=story,
                       memory_every=memory_every(stdout, job, extra_sets), **points)
