"""`undying spot-watch [--cloud aws|gcp] [--poll S] [--margin S]`: watch this VM's instance
metadata for a preemption notice and, when one comes, drain this Ray node by the notice's
deadline (`undying drain-node`'s drain); for Ray clusters on spot VMs without Kubernetes
(deploy/ray/cluster.yaml starts it on every worker).

A spot VM is reclaimed with a short notice that only the VM itself can read: EC2 announces a
Spot interruption two minutes ahead at `/latest/meta-data/spot/instance-action` (IMDSv2, a
session token first; `{"action": ..., "time": "<UTC>"}` once announced, 404 before), and GCE
flips `instance/preempted` to TRUE 30 s ahead. Nothing turns that into a Ray drain on a VM
cluster (Kubernetes does it through a pod's preStop hook, deploy/kuberay): without this the
node's ranks die with it, a node loss and a rollback to the last checkpoint; with it the
controller stops the job at a step boundary, saves it and moves the node's ranks off, no work
lost, when the notice holds a few steps and a save.

Protocol: one process per worker node, started after `ray start`, polling every `--poll` seconds
(AWS asks for 5). The first poll must answer (else exit 2: not on that cloud, or the metadata
service is unreachable); a later failed poll is logged and retried. On a notice it drains with
the deadline `--margin` seconds before the announced time and exits with the drain's code
(orchestrator.cli.drain_node.drain_until).
"""

from __future__ import annotations

import argparse
import calendar
import json
import sys
import time
import urllib.error
import urllib.request

from orchestrator.cli.exits import EXIT_USAGE

AWS_METADATA = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"
GCP_NOTICE_S = 30.0  # GCE's preemption notice
REQUEST_TIMEOUT_S = 2.0
HELP = "watch this VM's metadata for a spot preemption notice and drain this Ray node by its deadline"


def add_spot_watch_parser(sub) -> None:
    p = sub.add_parser("spot-watch", help=HELP, description=HELP)
    p.add_argument("--cloud", choices=("aws", "gcp"), default="aws", help="whose metadata (default %(default)s)")
    p.add_argument("--poll", type=float, default=5.0, help="seconds between polls (default %(default)g)")
    p.add_argument("--margin", type=float, default=5.0,
                   help="seconds before the announced time that the drain's deadline falls (default %(default)g)")
    p.add_argument("--address", default="auto", help="the Ray cluster (default %(default)s: this node's)")
    p.add_argument("--metadata", default=None,
                   help=f"the metadata service's base URL (default: {AWS_METADATA} on aws, {GCP_METADATA} on gcp)")


def spot_watch_main(args: argparse.Namespace) -> int:
    for flag, value in (("--poll", args.poll), ("--margin", args.margin)):
        if not 0 < value <= 600:
            print(f"undying spot-watch: {flag} must be a number of seconds above 0 and up to 600, not {value:g}",
                  file=sys.stderr)
            return EXIT_USAGE
    check = aws_notice if args.cloud == "aws" else gcp_notice
    base = (args.metadata or (AWS_METADATA if args.cloud == "aws" else GCP_METADATA)).rstrip("/")
    try:
        announced = check(base)
    except (OSError, ValueError) as err:
        print(f"undying spot-watch: no {args.cloud} instance metadata at {base} ({type(err).__name__}: {err}); run "
              "it on that cloud's VM, or name the service with --cloud and --metadata", file=sys.stderr)
        return EXIT_USAGE
    print(f"undying spot-watch: watching {base} every {args.poll:g} s", flush=True)
    announced = _watch(check, base, args.poll, announced)
    deadline = announced - args.margin
    print(f"undying spot-watch: preemption announced for {time.strftime('%H:%M:%S', time.gmtime(announced))} UTC, "
          f"in {announced - time.time():.0f} s; draining this node", flush=True)
    from orchestrator.cli.drain_node import drain_until

    return drain_until(args.address, None, "spot preemption notice", max(deadline, time.time() + 1.0))


def _watch(check, base: str, poll_s: float, announced: float | None) -> float:
    """Poll until a notice; its announced time (epoch seconds). A failed poll is logged once per streak."""
    failing = False
    while announced is None:
        time.sleep(poll_s)
        try:
            announced = check(base)
            failing = False
        except (OSError, ValueError) as err:
            if not failing:
                print(f"undying spot-watch: a poll failed ({type(err).__name__}: {err}); retrying", file=sys.stderr,
                      flush=True)
            failing = True
    return announced


def aws_notice(base: str) -> float | None:
    """EC2's Spot interruption time (epoch seconds), None while none is announced (IMDSv2)."""
    token_request = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    with urllib.request.urlopen(token_request, timeout=REQUEST_TIMEOUT_S) as answer:
        token = answer.read().decode()
    request = urllib.request.Request(f"{base}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": token})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            action = json.loads(answer.read())
    except urllib.error.HTTPError as err:
        if err.code == 404:  # nothing announced
            return None
        raise
    try:
        return float(calendar.timegm(time.strptime(action["time"], "%Y-%m-%dT%H:%M:%SZ")))
    except (KeyError, TypeError) as err:
        raise ValueError(f"spot/instance-action said {action!r}, without a time") from err


def gcp_notice(base: str) -> float | None:
    """When GCE will stop this preempted VM (epoch seconds: now plus its 30 s notice), None while it is not."""
    request = urllib.request.Request(f"{base}/computeMetadata/v1/instance/preempted",
                                     headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
        value = answer.read().decode().strip().upper()
    if value not in ("TRUE", "FALSE"):
        raise ValueError(f"instance/preempted said {value!r}, not TRUE or FALSE")
    return time.time() + GCP_NOTICE_S if value == "TRUE" else None
