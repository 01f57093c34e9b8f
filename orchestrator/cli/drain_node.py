"""`undying drain-node [--address ADDR] [--node-id HEX] [--wait S]`: tell Ray this node is going,
and wait until the ranks on it have moved off; a Ray worker pod's preStop hook (deploy/kuberay).

Kubernetes ends a pod (an eviction, a node drain, a spot reclaim, `kubectl delete pod`) with
SIGTERM to its container's first process, and SIGKILL at the end of the pod's grace. A rank that
dies with its pod is a node loss: the job rolls back to its last checkpoint. A node Ray is
draining is another matter: the controller sees it in the GCS's drain table
(orchestrator.cluster.drain), stops every rank at a step boundary, saves that step, and moves the
ranks to spares or shrinks past the node (orchestrator.controller.stopping): no work lost. This
command turns the pod's end into such a drain whatever the container's first process does with
SIGTERM (a shell that swallows it, an init process, a sidecar): it asks Ray's GCS to drain the
node for preemption with a deadline `--wait` seconds away (the controller sizes its stop to it),
then waits until no rank actor is alive on the node, and no longer: a pod without ranks, or
whose ranks have moved, ends at once. Like `ray drain-node`, with the wait for the ranks added.

Protocol: the hook runs once in the worker's container, before the container's SIGTERM; `--wait`
must stay under the pod's terminationGracePeriodSeconds. `--node-id` drains another node (an
operator's use, and the tests'); by default it is the node of the Ray this process connects to.

Exit codes: 0 no rank is left on the node; 1 ranks were still there at the deadline, or Ray did
not answer (the pod ends either way: a preStop hook's failure only delays it); 2 bad input (a
node id that names no live node, a negative wait).
"""

from __future__ import annotations

import argparse
import sys
import time

from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

# Actor classes that hold a job's ranks: the controller moves them off a draining node.
RANK_CLASSES = ("RankActor",)
POLL_S = 0.5
HELP = "drain this Ray node for preemption and wait until its ranks have moved off (a worker pod's preStop hook)"


def add_drain_node_parser(sub) -> None:
    p = sub.add_parser("drain-node", help=HELP, description=HELP)
    p.add_argument("--address", default="auto",
                   help="the Ray cluster (default %(default)s: the one this node belongs to)")
    p.add_argument("--node-id", default=None,
                   help="hex id of the node to drain (default: this node; `ray list nodes` lists them)")
    p.add_argument("--wait", type=float, default=50.0,
                   help="seconds until the node goes, the drain's deadline (default %(default)g: under the "
                        "pod's terminationGracePeriodSeconds)")
    p.add_argument("--reason", default="the pod is terminating",
                   help="why, as Ray's drain table and the job's log show it (default: %(default)s)")


def drain_node_main(args: argparse.Namespace) -> int:
    if not args.wait >= 0:
        print(f"undying drain-node: --wait must be 0 or more seconds, not {args.wait:g}", file=sys.stderr)
        return EXIT_USAGE
    import ray

    started = time.monotonic()
    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    except Exception as err:  # no Ray here: nothing to drain
        print(f"undying drain-node: no Ray cluster at {args.address!r} ({type(err).__name__}: {err})",
              file=sys.stderr)
        return EXIT_FAILED
    try:
        node = args.node_id or ray.get_runtime_context().get_node_id()
        if node not in live_nodes():
            print(f"undying drain-node: --node-id {node} names no live node of this cluster; `ray list nodes` "
                  "shows their ids", file=sys.stderr)
            return EXIT_USAGE
        deadline = time.time() + args.wait
        accepted, why = request_drain(node, args.reason, deadline)
        if not accepted:
            print(f"undying drain-node: Ray refused to drain node {node}: {why}", file=sys.stderr)
            return EXIT_FAILED
        print(f"undying drain-node: node {node[:12]} draining, deadline in {args.wait:g} s", flush=True)
        left = wait_for_ranks_to_leave(node, deadline, ranks_on)
    except Exception as err:  # the GCS went away meanwhile: the pod ends anyway
        print(f"undying drain-node: Ray stopped answering ({type(err).__name__}: {err})", file=sys.stderr)
        return EXIT_FAILED
    finally:
        ray.shutdown()
    took = time.monotonic() - started
    if left:
        print(f"undying drain-node: {left} rank(s) still on node {node[:12]} after {took:.1f} s: they are lost "
              "with it, and the job recovers from its last checkpoint", file=sys.stderr)
        return EXIT_FAILED
    print(f"undying drain-node: no rank on node {node[:12]} ({took:.1f} s)", flush=True)
    return EXIT_OK


def live_nodes() -> set[str]:
    import ray

    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def request_drain(node: str, reason: str, deadline: float) -> tuple[bool, str]:
    """Ask the GCS to drain `node` for preemption (a request Ray does not refuse) by `deadline`
    (epoch seconds); (accepted, Ray's reason when not)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    accepted, why = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   reason, int(deadline * 1000))
    return bool(accepted), str(why)


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
