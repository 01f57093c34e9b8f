"""`undying drain-node [--address ADDR] [--node-id HEX] [--wait S]`: tell Ray this node is going,
and wait until the ranks on it have moved off; a Ray worker pod's preStop hook (deploy/kuberay).

Kubernetes ends a pod (an eviction, a node drain, a spot reclaim, `kubectl delete pod`) with
SIGTERM to its container's first process, and SIGKILL at the end of the pod's grace. A rank that
dies with its pod is a node loss: the job rolls back to its last checkpoint. A node Ray is
draining is another matter: the controller sees it in the GCS's drain table
(orchestrator.cluster.drain), stops every rank at a step boundary, saves that step, and moves the
ranks to spares or shrinks past the node (orchestrator.controller.stopping): no work lost; a
parameter-server job cuts its segment there and moves its servers and workers (paramserver.moves). This
command turns the pod's end into such a drain whatever the container's first process does with
SIGTERM (Ray 2.60's `ray start --block` drains its node on SIGTERM itself, for
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s by default; a shell, an init process or an older Ray in
front of it does not): it asks Ray's GCS to drain the node for preemption with a deadline `--wait`
seconds away (the controller sizes its stop to it), then waits until no rank actor is alive on
the node, and no longer. Like `ray drain-node`, with the wait for the ranks added.

Protocol: the hook runs once in the worker's container, before the container's SIGTERM. The whole
command, Ray's start-up and every request included, ends within `--wait` seconds (and FINISH_S for
its last answer), which must stay under the pod's terminationGracePeriodSeconds: a request Ray
leaves hanging is abandoned at the deadline, so that the container still gets its SIGTERM before
the grace ends. That SIGTERM then starts `ray start`'s own drain of a node with no rank left, which
ends when its raylet has gone idle, or after RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, or at the
grace's SIGKILL. `--node-id` drains another node (an operator's use, and the tests'); by default
it is the node of the Ray this process connects to.

Exit codes: 0 no rank is left on the node; 1 ranks were still there at the deadline, or Ray did
not answer (the pod ends either way); 2 bad input (a node id that names no live node, a wait that
is not a number of seconds from 0 to 3600, this node when it is the cluster's head: the hook is a
worker pod's, and a head drained by mistake ends the cluster; `--node-id` names one on purpose).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

# Actor classes that hold a job's ranks: the controller moves a collective job's ranks off a
# draining node, a parameter-server job's supervisor its servers and workers (paramserver.moves).
RANK_CLASSES = ("RankActor", "ServerActor", "WorkerActor")
POLL_S = 0.5
FINISH_S = 3.0  # past the deadline: the last poll's answer and Ray's shutdown
MAX_WAIT_S = 3600.0  # no pod grace is longer in practice; a typo of minutes for seconds is refused
HELP = "drain this Ray node for preemption and wait until its ranks have moved off (a worker pod's preStop hook)"


def add_drain_node_parser(sub) -> None:
    p = sub.add_parser("drain-node", help=HELP, description=HELP)
    p.add_argument("--address", default="auto",
                   help="the Ray cluster (default %(default)s: the one this node belongs to)")
    p.add_argument("--node-id", default=None,
                   help="hex id of the node to drain (default: this node; `ray list nodes` lists them)")
    p.add_argument("--wait", type=float, default=50.0,
                   help="seconds until the node goes: the drain's deadline and the command's limit (default "
                        "%(default)g: under the pod's terminationGracePeriodSeconds)")
    p.add_argument("--reason", default="the pod is terminating",
                   help="why, as Ray records the drain (default: %(default)s)")


def drain_node_main(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.wait) and 0 <= args.wait <= MAX_WAIT_S):
        print(f"undying drain-node: --wait must be a number of seconds from 0 to {MAX_WAIT_S:g}, not {args.wait:g}",
              file=sys.stderr)
        return EXIT_USAGE
    return drain_until(args.address, args.node_id, args.reason, time.time() + args.wait)


def drain_until(address: str, node_id: str | None, reason: str, deadline: float) -> int:
    """Drain `node_id` (None: this process's node) by `deadline` (epoch seconds: the node goes then)
    and wait for its ranks to leave; returns the exit code. Ends by the deadline and FINISH_S
    however long Ray takes to answer (also `undying spot-watch`'s drain)."""
    outcome: list[int] = []
    worker = threading.Thread(target=lambda: outcome.append(_drain(address, node_id, reason, deadline)),
                              name="undying-drain-node", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.time()) + FINISH_S)
    if outcome:
        return outcome[0]
    print("undying drain-node: Ray did not answer by the drain's deadline; giving up (a preStop hook must end "
          "within its pod's grace, a spot VM's watcher before its VM)", file=sys.stderr, flush=True)
    return abandon(EXIT_FAILED)


def abandon(code: int) -> int:
    """Exit now, past the thread stuck inside Ray (an orderly exit would wait on Ray's own shutdown)."""
    sys.stdout.flush()
    os._exit(code)


def _drain(address: str, node_id: str | None, reason: str, deadline: float) -> int:
    import ray

    started = time.monotonic()
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as err:  # no Ray here: nothing to drain
        print(f"undying drain-node: no Ray cluster at {address!r} ({type(err).__name__}: {err})", file=sys.stderr)
        return EXIT_FAILED
    try:
        node = (node_id or ray.get_runtime_context().get_node_id()).lower()  # Ray's ids are lower-case hex
        live = live_nodes()
        if node not in live:
            named = f"--node-id {node} names" if node_id else f"this process's node {node} is"
            print(f"undying drain-node: {named} no live node of this cluster; `ray list nodes` shows their ids",
                  file=sys.stderr)
            return EXIT_USAGE
        if node_id is None and live[node]:  # the hook belongs on worker pods: this is a mistake or a test
            print(f"undying drain-node: this process's node {node[:12]} is the head of the cluster at {address!r} "
                  "(its GCS and the jobs' drivers run there), which a drain would end; run the hook on worker "
                  "nodes only, or name a node with --node-id", file=sys.stderr)
            return EXIT_USAGE
        accepted, why = request_drain(node, reason, deadline)
        if not accepted:
            print(f"undying drain-node: Ray refused to drain node {node}: {why}", file=sys.stderr)
            return EXIT_FAILED
        print(f"undying drain-node: node {node[:12]} draining, deadline in {deadline - time.time():.0f} s",
              flush=True)
        left = wait_for_ranks_to_leave(node, deadline, ranks_on)
    except Exception as err:  # the GCS failed or went away meanwhile: the pod ends anyway
        print(f"undying drain-node: the drain failed ({type(err).__name__}: {err})", file=sys.stderr)
        return EXIT_FAILED
    finally:
        ray.shutdown()
    return _report_outcome(node, left, time.monotonic() - started)


def _report_outcome(node: str, left: int, took: float) -> int:
    if left:
        print(f"undying drain-node: {left} rank(s) still on node {node[:12]} after {took:.1f} s: they are lost "
              "with it, and the job recovers from its last checkpoint", file=sys.stderr)
        return EXIT_FAILED
    print(f"undying drain-node: no rank on node {node[:12]} ({took:.1f} s)", flush=True)
    return EXIT_OK


def live_nodes() -> dict[str, bool]:
    """{node id: whether it is the head} of the cluster's live nodes."""
    import ray

    return {node["NodeID"]: "node:__internal_head__" in node.get("Resources", {})
            for node in ray.nodes() if node.get("Alive")}


def request_drain(node: str, reason: str, deadline: float) -> tuple[bool, str]:
    """Ask the GCS to drain `node` for preemption (a request Ray does not refuse) by `deadline`
    (epoch seconds), waiting for its answer no later than the deadline; (accepted, Ray's reason
    when not)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    accepted, why = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   reason, int(deadline * 1000), timeout=max(1.0, deadline - time.time()))
    return bool(accepted), why.decode(errors="replace") if isinstance(why, bytes) else str(why)


def ranks_on(node: str) -> int:
    """How many rank actors are alive on `node`, from the GCS's actor table."""
    import ray._private.state

    alive = ray._private.state.actors(actor_state_name="ALIVE").values()
    return sum(1 for actor in alive if actor["Address"]["NodeID"] == node and actor["ActorClassName"] in RANK_CLASSES)


def wait_for_ranks_to_leave(node: str, deadline: float, count, clock=time.time, sleep=time.sleep) -> int:
    """Poll `count(node)` until it is 0 or `deadline` (epoch seconds) passes; the last count."""
    while True:
        left = count(node)
        if left == 0 or clock() >= deadline:
            return left
        sleep(min(POLL_S, max(0.0, deadline - clock())))
