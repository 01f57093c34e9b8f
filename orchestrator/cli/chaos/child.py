"""`undying chaos` with kill_controller: the controller runs in a child process, rerun after each kill.

Protocol: orchestrator.cli.chaos.command uses `run_rerunning` as its runner when the spec holds a
kill_controller fault (`kills_controller`). It starts

    python -m orchestrator.cli.chaos.child REPORT.json PIDS.json [--address ADDR]

with the validated spec's JSON on the child's stdin: the spec carries its storage options
inline (credentials read from a storage_options_file included), so it goes through a pipe,
never into a file or onto the command line.

which is `undying run` (orchestrator.cli.run.run_job) with the chaos command's rank-PID recording:
each rank PID is written to PIDS.json as soon as the rank reports it, since a controller killed
by SIGKILL writes nothing at its end. When the child dies by SIGKILL and a kill_controller fault
of the spec has been recorded as fired since it started (orchestrator.controller.kill), the job
is run again, as an operator would after losing the driver: it resumes from its last committed
checkpoint, and Ray has ended the dead driver's rank actors. Any other end is final. At most one
rerun per kill_controller fault, since each fires once per job.

The outcome joins every attempt: the last one's exit code and report, every rank PID any attempt
had (the dead controller's ranks must be gone as well: the "no process left" check), and the wall
time of all attempts together. A killed attempt writes no report; its faults and failures join the
last report's, in order, from what its event log holds (monitor.event_log: flushed every 10 s and
at each commit, so what it logged in its last seconds is lost with it) and from the marker of the
kill_controller fault that killed it (its step, point and job seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from orchestrator.cli.chaos.runs import RankPidRecorder, RunOutcome
from orchestrator.cli.exits import EXIT_FAILED


def kills_controller(spec) -> bool:
    return any(f.kind == "kill_controller" for f in spec.chaos.faults)


def _fired_now(spec, storage, retry) -> set[int]:
    """Ids of the spec's kill_controller faults recorded as fired beside its checkpoints (a store
    failing transiently is retried for `checkpoint.read_retry_s`: a rerun hangs on the answer)."""
    from chaos.config import ArmedFault
    from orchestrator.controller.kill import has_fired

    faults = [ArmedFault.of(f, i) for i, f in enumerate(spec.chaos.faults) if f.kind == "kill_controller"]
    return {f.id for f in faults if retry.call(lambda f=f: has_fired(storage, f), "reading a kill_controller marker")}


def _runs_now(storage, retry) -> set[str]:
    """The event log's runs beside the checkpoints (retried as `_fired_now`)."""
    from monitor.event_log import list_runs

    return set(retry.call(lambda: list_runs(storage), "listing the event log's runs"))


def _read_pids(path: str) -> tuple[dict[str, int], dict[str, str], int]:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):  # the child died before its first rank answered
        return {}, {}, 0
    return {k: int(v) for k, v in data["pids"].items()}, dict(data["starts"]), int(data.get("elsewhere", 0))


def run_rerunning(spec, *, address: str | None, report_path: str) -> RunOutcome:
    """Run the job in a child process; rerun it while it died from a kill_controller fault."""
    from ckpt.storage_errors import ReadRetry
    from monitor.report import RunReport
    from orchestrator.cli.chaos.experiment import catalog_of

    kills = sum(1 for f in spec.chaos.faults if f.kind == "kill_controller")
    storage = catalog_of(spec).storage  # the event log's runs and the kill markers, beside the checkpoints
    retry = ReadRetry(spec.checkpoint.read_retry_s)
    killed_runs: list[tuple[list[str], set[int]]] = []  # each killed attempt's event-log runs and fault ids
    pids: dict[str, int] = {}
    starts: dict[str, str] = {}
    wall, code, elsewhere = 0.0, EXIT_FAILED, 0
    spec_json = spec.model_dump_json(by_alias=True)
    with tempfile.TemporaryDirectory(prefix="undying-chaos-child-") as tmp:
        for attempt in range(kills + 1):
            fired_before, runs_before = _fired_now(spec, storage, retry), _runs_now(storage, retry)
            pids_path = os.path.join(tmp, f"pids-{attempt}.json")
            cmd = [sys.executable, "-m", "orchestrator.cli.chaos.child", report_path, pids_path]
            sys.stdout.flush()
            started = time.monotonic()
            code = subprocess.run(cmd + (["--address", address] if address else []), input=spec_json,
                                  text=True).returncode
            wall += time.monotonic() - started
            more_pids, more_starts, more_elsewhere = _read_pids(pids_path)
            elsewhere += more_elsewhere
            pids.update({f"run {attempt} {k}": v for k, v in more_pids.items()})
            starts.update({f"run {attempt} {k}": v for k, v in more_starts.items()})
            killed = code == -signal.SIGKILL and _fired_now(spec, storage, retry) - fired_before
            if not killed:
                break
            killed_runs.append((sorted(_runs_now(storage, retry) - runs_before), killed))
            print(f"undying chaos: the controller died from kill_controller (SIGKILL); running the job again "
                  f"(rerun {attempt + 1}) to resume from its last committed checkpoint", flush=True)
    report = RunReport.from_json(report_path) if os.path.exists(report_path) else None
    if report is not None and killed_runs:
        report = _with_killed_attempts(report, spec, storage, killed_runs)
    return RunOutcome(code if code >= 0 else EXIT_FAILED, report, pids, wall, starts, elsewhere)


def _with_killed_attempts(report, spec, storage, killed_runs: list[tuple[list[str], set[int]]]):
    """`report` (the last attempt's) with the faults and failures of the killed attempts before it."""
    from monitor.event_log import read_run
    from monitor.events import report_from_events

    faults, failures = [], []
    for runs, fault_ids in killed_runs:
        for run in runs:
            try:
                earlier = report_from_events(read_run(storage, run))
            except (OSError, ValueError) as err:  # an empty or unreadable log: that attempt's kill is still known
                print(f"undying chaos: the event log of killed run {run} cannot be read ({err})", flush=True)
                continue
            faults += earlier.faults
            failures += earlier.failures
        faults += [_kill_record(spec, storage, fault_id) for fault_id in sorted(fault_ids)]
    return report.model_copy(update={"faults": faults + report.faults, "failures": failures + report.failures})


def _kill_record(spec, storage, fault_id: int):
    """The kill_controller fault `fault_id` as a FaultRecord, from the marker it wrote as it fired."""
    from chaos.config import ArmedFault
    from monitor.report import FaultRecord
    from orchestrator.controller.kill import MARKER_DIR, marker_name

    marker = marker_name(ArmedFault.of(spec.chaos.faults[fault_id], fault_id))
    try:
        fired = json.loads(storage.read(storage.path(MARKER_DIR, marker)))
    except (OSError, ValueError):
        fired = {}
    return FaultRecord(time=fired.get("job_s"), kind="kill_controller", step=fired.get("step"),
                       point=fired.get("point"))


def _write_pids(path: str, recorder: RankPidRecorder) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"pids": recorder.seen, "starts": recorder.starts, "elsewhere": len(recorder.elsewhere)}, handle)
    os.replace(tmp, path)  # whole or not at all, whenever the SIGKILL comes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.cli.chaos.child")
    parser.add_argument("report")
    parser.add_argument("pids")
    parser.add_argument("--address")
    args = parser.parse_args(argv)
    from orchestrator.cli.run import run_job
    from orchestrator.spec.job_spec import JobSpec

    spec = JobSpec.model_validate_json(sys.stdin.read())  # a pipe from run_rerunning (see the module doc)
    recorder = RankPidRecorder(lambda recorder: _write_pids(args.pids, recorder))
    return run_job(spec, address=args.address, report_path=args.report, timeline_path=None,
                   worker_group=recorder.group_class, experiment=True)


if __name__ == "__main__":
    sys.exit(main())
