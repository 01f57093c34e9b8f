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
service is unreachable); a later failed poll is said once per failing streak and retried. A
notice's time is the one it announces; a notice without one (GCE's, or an EC2 answer that does
not parse) is dated from the last poll that saw none, plus the cloud's notice. The drain's
deadline falls `--margin` seconds before that time, or at the time itself when the margin no
longer fits; a notice already past drains nothing (the node is a loss). It exits with the
drain's code (orchestrator.cli.drain_node.drain_until). On GCE the guest starts shutting down
with the notice, so the container has only docker's stop timeout (10 s by default) unless its
run options raise it.
"""

from __future__ import annotations

import argparse
import calendar
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from orchestrator.cli.exits import EXIT_FAILED, EXIT_USAGE

REQUEST_TIMEOUT_S = 2.0
MIN_DRAIN_S = 5.0  # less than this before the announced time: drain up to the time itself
# What a poll of a metadata service may raise (urllib's HTTPException is not an OSError).
POLL_ERRORS = (OSError, ValueError, http.client.HTTPException)
HELP = "watch this VM's metadata for a spot preemption notice and drain this Ray node by its deadline"
# Metadata requests never go through a proxy (urllib would honour HTTP_PROXY).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
NO_TIME = -1.0  # a notice that came without a time of its own


@dataclass(frozen=True)
class Cloud:
    metadata: str  # the service's base URL
    notice_s: float  # how far ahead the cloud announces a preemption


CLOUDS = {"aws": Cloud("http://169.254.169.254", 120.0), "gcp": Cloud("http://metadata.google.internal", 30.0)}


def add_spot_watch_parser(sub) -> None:
    p = sub.add_parser("spot-watch", help=HELP, description=HELP)
    p.add_argument("--cloud", choices=sorted(CLOUDS), default="aws", help="whose metadata (default %(default)s)")
    p.add_argument("--poll", type=float, default=5.0,
                   help="seconds between polls, at most a quarter of the cloud's notice (default %(default)g)")
    p.add_argument("--margin", type=float, default=5.0,
                   help="seconds before the announced time that the drain's deadline falls, under half the "
                        "cloud's notice (default %(default)g)")
    p.add_argument("--address", default="auto", help="the Ray cluster (default %(default)s: this node's)")
    p.add_argument("--metadata", default=None, help="the metadata service's base URL (default: the cloud's, "
                   + ", ".join(f"{name} {cloud.metadata}" for name, cloud in sorted(CLOUDS.items())) + ")")


def spot_watch_main(args: argparse.Namespace) -> int:
    cloud = CLOUDS[args.cloud]
    bounds = (("--poll", args.poll, 0 < args.poll <= cloud.notice_s / 4, f"up to {cloud.notice_s / 4:g}"),
              ("--margin", args.margin, 0 < args.margin < cloud.notice_s / 2, f"below {cloud.notice_s / 2:g}"))
    for flag, value, fits, most in bounds:
        if not fits:  # NaN fits nothing
            print(f"undying spot-watch: {flag} must be a number of seconds above 0 and {most} on {args.cloud} (its "
                  f"notice comes {cloud.notice_s:g} s ahead), not {value:g}", file=sys.stderr)
            return EXIT_USAGE
    check = aws_notice if args.cloud == "aws" else gcp_notice
    base = (args.metadata or cloud.metadata).rstrip("/")
    quiet_at = time.time()
    try:
        announced = check(base)
    except POLL_ERRORS as err:
        print(f"undying spot-watch: no {args.cloud} instance metadata at {base} ({type(err).__name__}: {err}); run "
              "it on that cloud's VM, or name the service with --cloud and --metadata", file=sys.stderr)
        return EXIT_USAGE
    import ray  # noqa: F401  (now, not inside the notice's short window)

    print(f"undying spot-watch: watching {base} every {args.poll:g} s", flush=True)
    announced = _watch(check, base, args.poll, announced, quiet_at, cloud.notice_s)
    return _drain_before(announced, args)


def _drain_before(announced: float, args: argparse.Namespace) -> int:
    """Drain this node by `announced` (epoch seconds) less the margin, or by `announced` itself
    when the margin leaves too little; nothing when it has passed."""
    left = announced - time.time()
    when = time.strftime("%H:%M:%S", time.gmtime(announced))
    if left <= 1.0:
        print(f"undying spot-watch: preemption announced for {when} UTC ({left:+.0f} s from now): too late to "
              "drain; the node's ranks are lost with it", file=sys.stderr, flush=True)
        return EXIT_FAILED
    deadline = announced - args.margin if left - args.margin >= MIN_DRAIN_S else announced
    print(f"undying spot-watch: preemption announced for {when} UTC, in {left:.0f} s; draining this node",
          flush=True)
    from orchestrator.cli.drain_node import drain_until

    return drain_until(args.address, None, "spot preemption notice", deadline)


def _watch(check, base: str, poll_s: float, announced: float | None, quiet_at: float, notice_s: float) -> float:
    """Poll until a notice; its time (epoch seconds). A notice without a time is dated from the last
    poll that saw none (`quiet_at`), plus the cloud's notice. A failed poll is said once per streak."""
    failing = False
    while announced is None:
        time.sleep(poll_s)
        polled_at = time.time()
        try:
            announced = check(base)
        except POLL_ERRORS as err:
            if not failing:
                print(f"undying spot-watch: a poll failed ({type(err).__name__}: {err}); retrying", file=sys.stderr,
                      flush=True)
            failing = True
            continue
        failing = False
        if announced is None:
            quiet_at = polled_at
    return quiet_at + notice_s if announced == NO_TIME else announced


def aws_notice(base: str) -> float | None:
    """EC2's Spot interruption time (epoch seconds), None while none is announced (IMDSv2), NO_TIME
    for an announcement whose time does not parse: any answer there is a notice."""
    token_request = urllib.request.Request(f"{base}/latest/api/token", method="PUT",
                                           headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    with _OPENER.open(token_request, timeout=REQUEST_TIMEOUT_S) as answer:
        token = answer.read().decode()
    request = urllib.request.Request(f"{base}/latest/meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": token})
    try:
        with _OPENER.open(request, timeout=REQUEST_TIMEOUT_S) as answer:
            body = answer.read()
    except urllib.error.HTTPError as err:
        if err.code == 404:  # nothing announced
            return None
        raise
    try:
        action = json.loads(body)
        return float(calendar.timegm(time.strptime(action["time"], "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, KeyError, TypeError):
        print(f"undying spot-watch: an interruption notice whose time does not parse: {body[:200]!r}",
              file=sys.stderr, flush=True)
        return NO_TIME


def gcp_notice(base: str) -> float | None:
    """NO_TIME once GCE has marked this VM preempted (its notice has no time of its own), None while not."""
    request = urllib.request.Request(f"{base}/computeMetadata/v1/instance/preempted",
                                     headers={"Metadata-Flavor": "Google"})
    with _OPENER.open(request, timeout=REQUEST_TIMEOUT_S) as answer:
        value = answer.read().decode().strip().upper()
    if value not in ("TRUE", "FALSE"):
        raise ValueError(f"instance/preempted said {value!r}, not TRUE or FALSE")
    return NO_TIME if value == "TRUE" else None
