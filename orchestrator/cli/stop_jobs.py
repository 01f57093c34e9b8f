"""`undying stop-jobs [--address URL] [--wait S]`: SIGTERM the drivers of this Ray cluster's jobs
and wait for them to end; a Ray head pod's preStop hook (deploy/kuberay).

Kubernetes ends a pod (an eviction, a node drain, a spot reclaim where the node's shutdown grace
allows, `kubectl delete pod`) with SIGTERM to its container's first process, which on a KubeRay
head is `ray start --block` or the shell around it: neither passes it on to the jobs' drivers, so
`undying run`, a Ray job on that head, would never hear of it and die with the pod (Ray stops its
processes, or the grace's SIGKILL does) with no checkpoint. Run before that SIGTERM, this
command sends SIGTERM to each running job's driver process itself (the preemption path: a
checkpoint at the next step boundary, exit 75; docs/design.md) and waits for the jobs to end, for
at most `--wait` seconds, which the pod's terminationGracePeriodSeconds must exceed. Not through
Ray's `stop_job`: a stopped job ends STOPPED, which KubeRay takes for a completed RayJob, where a
driver that exits 75 fails the job and the RayJob's backoffLimit resumes it from that checkpoint on
a new cluster. A job whose driver has not registered yet (no pid known) is stopped through the job
API instead. Each request to the API times out after a few seconds: a hung dashboard must not hold
the hook past the grace.

Protocol: the hook runs in the head's container (the drivers of jobs submitted to the cluster run
there, as the container's user), once, before the container's SIGTERM.

Exit codes: 0 every job ended (or none ran); 1 some still ran after --wait, or the job API did not
answer (the pod ends either way: a preStop hook's failure only delays it); 2 a --wait that is not a
number of seconds from 0 to 3600. A job whose stop fails (its driver another user's) is reported,
and the others are stopped all the same.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sys
import time

from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

LIVE = ("PENDING", "RUNNING")
REQUEST_TIMEOUT_S = 5.0
MAX_WAIT_S = 3600.0  # as drain-node's: a preStop hook longer than an hour is a typo


HELP = "SIGTERM this Ray cluster's job drivers and wait for them to end (a head pod's preStop hook)"


def add_stop_jobs_parser(sub) -> None:
    p = sub.add_parser("stop-jobs", help=HELP, description=HELP)
    p.add_argument("--address", default="http://127.0.0.1:8265",
                   help="Ray's job API, the head's dashboard (default: this pod's, %(default)s)")
    p.add_argument("--wait", type=float, default=50.0,
                   help="seconds to wait for the jobs to end (default %(default)g: below the pod's grace)")


def stop_jobs_main(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.wait) and 0 <= args.wait <= MAX_WAIT_S):
        print(f"undying stop-jobs: --wait must be a number of seconds from 0 to {MAX_WAIT_S:g} (under the pod's "
              f"grace), not {args.wait:g}", file=sys.stderr)
        return EXIT_USAGE
    # The job API's client sets no timeout of its own: the process's default bounds each request,
    # put back afterwards (a caller in the same process keeps its sockets as they were).
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(REQUEST_TIMEOUT_S)
    try:
        return _stop_all(args)
    finally:
        socket.setdefaulttimeout(previous)


def _stop_all(args: argparse.Namespace) -> int:
    from ray.job_submission import JobSubmissionClient

    started = time.monotonic()
    try:
        client = JobSubmissionClient(args.address)
        live = [job for job in client.list_jobs() if str(job.status) in LIVE and job.submission_id]
        for job in live:
            print(f"undying stop-jobs: job {job.submission_id}: {_stop_one(client, job)}", flush=True)
        waiting = [job.submission_id for job in live]
        while waiting and time.monotonic() - started < args.wait:
            time.sleep(0.5)
            waiting = [job for job in waiting if str(client.get_job_status(job)) in LIVE]
    except Exception as err:  # the dashboard is down or hung: nothing to stop through it
        print(f"undying stop-jobs: Ray's job API at {args.address} did not answer ({type(err).__name__}: {err})",
              file=sys.stderr)
        return EXIT_FAILED
    if waiting:
        print(f"undying stop-jobs: job(s) {waiting} still running after {args.wait:g} s", file=sys.stderr)
        return EXIT_FAILED
    print(f"undying stop-jobs: no job running ({time.monotonic() - started:.1f} s)", flush=True)
    return EXIT_OK


def _stop_one(client, job) -> str:
    """`_stop`, whose failure for one job (a driver of another user, a refused stop) is reported and
    leaves the others to be stopped: each job not stopped dies with the pod, without its checkpoint."""
    try:
        return _stop(client, job)
    except Exception as err:  # noqa: BLE001 (os.kill's PermissionError, the job API's errors)
        return f"not stopped ({type(err).__name__}: {err}); the other jobs are stopped all the same"


def _stop(client, job) -> str:
    """SIGTERM to the job's driver process (its own exit code then ends the job) when it runs here,
    on this node (a pid names a process of this node only), else Ray's stop."""
    from ray._private.services import get_node_ip_address

    driver = job.driver_info
    pid = driver.pid if driver is not None and driver.node_ip_address == get_node_ip_address() else None
    if pid:
        try:
            os.kill(int(pid), signal.SIGTERM)
            return f"SIGTERM sent to its driver (pid {pid})"
        except ProcessLookupError:  # ended meanwhile
            return f"its driver (pid {pid}) has already ended"
    client.stop_job(job.submission_id)
    return "its driver is not a known process of this node: stopped through Ray's job API"
