"""Running one job for `undying chaos`, recording the PIDs of its rank processes.

Protocol: `run_recorded(spec, address=..., report_path=...)` is the chaos command's runner
for a job whose controller does not kill itself (orchestrator.cli.chaos.child runs one that
does, with the same recording). It runs `undying run` in this process
(orchestrator.cli.run.run_job) with a `RankPidRecorder`'s worker-group class, so every rank
actor's PID is known; after the run, `wait_for_exit` gives those processes a grace period
and returns the ones the "no process left" invariant must find gone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.cluster.worker_group import RayWorkerGroup

# After the run, rank processes get this long to exit (Ray's kill is asynchronous) before the
# "no process left" check looks.
EXIT_GRACE_S = 15.0


@dataclass
class RunOutcome:
    """What one job run left: its exit code, report (None if it never started), rank PIDs, outside wall."""

    code: int
    report: object | None
    pids: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    starts: dict[str, str] = field(default_factory=dict)  # label -> /proc start time when recorded
    elsewhere: int = 0  # rank processes on other hosts, which the check on this one cannot see

    def pids_to_check(self) -> dict[str, int] | None:
        """`wait_for_exit`'s PIDs; None (the check skipped, not passed) when every rank ran elsewhere."""
        if not self.pids and self.elsewhere:
            return None
        return wait_for_exit(self)


class RankPidRecorder:
    """Keeps the PID each rank actor reports in its ping, with its start time: `seen`, `starts`.

    `group_class` is a RayWorkerGroup that records; pass it to run_job as its worker group.
    Only PIDs on this host are kept (the check reads /proc here), each with its start time, so a
    PID reused by another process later is not taken for a rank that survived; the actors on other
    hosts are counted in `elsewhere`. `on_record(recorder)` is called after each new one (a
    controller that may die writes them out as it goes).
    """

    def __init__(self, on_record: Callable[[RankPidRecorder], None] | None = None):
        self.seen: dict[str, int] = {}
        self.starts: dict[str, str] = {}
        self.elsewhere: set[str] = set()  # actor ids of ranks on other hosts
        self._on_record = on_record
        self._here: set[str] = set()  # ids of the Ray nodes on this host (`local_nodes`)
        self._looked: set[str] = set()  # the nodes the ranks reported so far
        recorder = self

        class RecordingWorkerGroup(RayWorkerGroup):
            def _remember_node(self, actor, info) -> None:
                super()._remember_node(actor, info)
                recorder.remember(actor, info)

        self.group_class = RecordingWorkerGroup

    def remember(self, actor, info) -> None:

        if not isinstance(info, dict) or not info.get("pid"):
            return
        node = info.get("node") or ""
        if node not in self._looked:  # a node not seen before: the cluster's nodes read again
            self._here, self._looked = local_nodes(), self._looked | {node}
        if node not in self._here:
            self.elsewhere.add(actor._actor_id.hex())
        else:
            label = f"actor {actor._actor_id.hex()[:8]} pid"
            self.seen[label] = int(info["pid"])
            self.starts[label] = start_time(int(info["pid"])) or ""
        if self._on_record is not None:
            self._on_record(self)


def local_nodes() -> set[str]:
    """The ids of the Ray nodes on this host, whose processes' PIDs are this host's: by hostname (one
    machine running several raylets, as a test cluster does) or by address (the driver's own, or
    loopback: a laptop's `ray start --node-ip-address 127.0.0.1` reads otherwise than its interface)."""
    import socket

    import ray

    addresses = {"127.0.0.1", "localhost", ray.util.get_node_ip_address()}
    host = socket.gethostname()
    return {n["NodeID"] for n in ray.nodes()
            if n.get("NodeManagerHostname") == host or n.get("NodeManagerAddress") in addresses}


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def run_recorded(spec, *, address: str | None, report_path: str) -> RunOutcome:
    """`undying run` in this process (orchestrator.cli.run.run_job), recording the rank PIDs."""
    import ray

    from monitor.report import RunReport
    from orchestrator.cli.run import run_job

    recorder = RankPidRecorder()
    started = time.monotonic()
    try:
        code = run_job(spec, address=address, report_path=report_path, timeline_path=None,
                       worker_group=recorder.group_class, experiment=True)
    finally:
        # run_job leaves a cluster it joined connected; the next run of this process (the chaos
        # run after its reference, a sweep's next interval) must connect afresh.
        if ray.is_initialized():
            ray.shutdown()
    wall = time.monotonic() - started
    report = RunReport.from_json(report_path) if os.path.exists(report_path) else None
    return RunOutcome(code, report, dict(recorder.seen), wall, dict(recorder.starts), len(recorder.elsewhere))


def wait_for_exit(outcome: RunOutcome, grace_s: float = EXIT_GRACE_S) -> dict[str, int]:
    """Give the rank processes `grace_s` to exit (Ray kills asynchronously); returns the PIDs for the
    check, less those now held by another process (another start time: the rank's is long gone)."""
    def same_process(label: str) -> bool:
        recorded = outcome.starts.get(label)
        return not recorded or start_time(outcome.pids[label]) in (None, recorded)

    def running() -> bool:
        return any(same_process(label) and os.path.exists(f"/proc/{pid}") for label, pid in outcome.pids.items())

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and running():
        time.sleep(0.2)
    return {label: pid for label, pid in outcome.pids.items() if same_process(label)}
