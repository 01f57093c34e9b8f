"""What `undying chaos --mtbf 20s` kills when neither `--kind` nor the spec's `chaos.mtbf_kind` says.

The spec's default is kill_node, a failure a multi-node job must survive. On one node (the
embedded local Ray, where the README runs chaos) every rank shares the controller's node, so the
controller refuses a random node kill: it would kill the controller itself. There the command
picks kill_rank instead and says so.

Protocol: orchestrator.cli.chaos.command calls `with_default_kind(spec, address)` once, after the
spec is loaded and before any run; it returns the spec to run (itself when the kind was given).
"""

from __future__ import annotations

import os

SINGLE_NODE_KIND = "kill_rank"


def kind_was_given(spec) -> bool:
    """Whether the YAML, a `--set` or `--kind` named chaos.mtbf_kind (pydantic keeps the keys it was given)."""
    return "mtbf_kind" in spec.chaos.model_fields_set


def default_kind(spec, nodes: int | None) -> str | None:
    """The kind to use in place of the spec's default on a cluster of `nodes` alive nodes, or None
    to keep the spec's (a kind was given, no random failures, or the node count is unknown)."""
    if spec.chaos.mtbf_s is None or kind_was_given(spec) or nodes is None:
        return None
    return SINGLE_NODE_KIND if nodes <= 1 else None


def cluster_nodes(address: str | None) -> int | None:
    """Alive nodes of the cluster the job will run on: 1 for the embedded local Ray (no address);
    for an address, the cluster is asked (connect, count, disconnect: the run connects afresh).
    None when it cannot be reached; the run then reports that itself."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        return 1
    import ray

    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return sum(1 for node in ray.nodes() if node.get("Alive"))
    except (ConnectionError, RuntimeError, ValueError):
        return None
    finally:
        if ray.is_initialized():
            ray.shutdown()


def with_default_kind(spec, address: str | None, nodes_of=cluster_nodes):
    """`spec`, with chaos.mtbf_kind set to kill_rank when no kind was given and the cluster has one
    node (a line says so); `nodes_of(address)` counts the nodes (replaced in tests)."""
    if spec.chaos.mtbf_s is None or kind_was_given(spec):
        return spec
    kind = default_kind(spec, nodes_of(address))
    if kind is None:
        return spec
    from orchestrator.cli.chaos.experiment import with_changes

    print(f"undying chaos: one node (the controller's), so random failures are {kind} (a node kill would kill "
          f"the controller); give --kind to choose", flush=True)
    return with_changes(spec, {"chaos.mtbf_kind": kind})
