"""`undying stop-jobs [--address URL] [--wait S]`: stop the Ray jobs of this cluster and wait for
them to end; a Ray head pod's preStop hook (deploy/kuberay).

Kubernetes ends a pod (an eviction, a node drain, a spot reclaim, `kubectl delete pod`) with
SIGTERM to its container's first process, which on a KubeRay head is the shell around `ray start
--block`: it neither handles nor forwards it, so `undying run`, a Ray job on that head, would never
hear of it and die with the pod at the grace's end, SIGKILLed, with no checkpoint. Run before that
SIGTERM, this command stops every job through Ray's job API, as `ray job stop` does: Ray's job
supervisor sends the driver SIGTERM (the preemption path: a checkpoint at the next step
boundary, exit 75; docs/design.md) and SIGKILLs it after RAY_JOB_STOP_WAIT_TIME_S. It returns once
no job runs, or after `--wait` seconds, which the pod's terminationGracePeriodSeconds must exceed.
A stopped job is then retried by the RayJob's backoffLimit and resumes from that checkpoint.

Exit codes: 0 every job ended (or none ran); 1 some still ran after --wait, or the job API did not
answer (the pod ends either way: a preStop hook's failure only delays it).
"""

from __future__ import annotations

import argparse
import sys
import time

from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK

LIVE = ("PENDING", "RUNNING")


HELP = "stop this Ray cluster's jobs and wait for them to end (a head pod's preStop hook)"


def add_stop_jobs_parser(sub) -> None:
    p = sub.add_parser("stop-jobs", help=HELP, description=HELP)
    p.add_argument("--address", default="http://127.0.0.1:8265",
                   help="Ray's job API, the head's dashboard (default: this pod's, %(default)s)")
    p.add_argument("--wait", type=float, default=50.0,
                   help="seconds to wait for the jobs to end (default %(default)g: below the pod's grace)")


def stop_jobs_main(args: argparse.Namespace) -> int:
    from ray.job_submission import JobSubmissionClient

    started = time.monotonic()
    try:
        client = JobSubmissionClient(args.address)
        live = [job.submission_id for job in client.list_jobs() if str(job.status) in LIVE and job.submission_id]
        for job in live:
            client.stop_job(job)
            print(f"undying stop-jobs: asked job {job} to stop (its driver gets SIGTERM)", flush=True)
        while live and time.monotonic() - started < args.wait:
            time.sleep(0.5)
            live = [job for job in live if str(client.get_job_status(job)) in LIVE]
    except Exception as err:  # the dashboard is down: nothing to stop through it
        print(f"undying stop-jobs: Ray's job API at {args.address} did not answer ({type(err).__name__}: {err})",
              file=sys.stderr)
        return EXIT_FAILED
    if live:
        print(f"undying stop-jobs: job(s) {live} still running after {args.wait:g} s", file=sys.stderr)
        return EXIT_FAILED
    print(f"undying stop-jobs: no job running ({time.monotonic() - started:.1f} s)", flush=True)
    return EXIT_OK
