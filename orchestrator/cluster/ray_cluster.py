"""Connect to a running Ray cluster, or start an embedded local one.

Called once by the CLI, in the driver process. With an address (`--address` or
`RAY_ADDRESS`) the job joins that cluster; otherwise an embedded single-node Ray starts
with enough logical CPUs for the job's ranks (CPU ranks on a small machine share cores,
which is what a local demo or test wants) and stops when the job ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray

from orchestrator.cluster.address import check_address, unreachable


@dataclass
class RayConnection:
    embedded: bool
    rendezvous_host: str  # where ranks reach the controller's store
    env_vars: dict[str, str]  # environment for rank actors

    def close(self) -> None:
        if self.embedded and ray.is_initialized():
            ray.shutdown()


def connect(address: str | None, cpus_needed: float, gpus_needed: float) -> RayConnection:
    """Join the cluster at `address` (else $RAY_ADDRESS), else start an embedded one; an address that
    cannot reach a cluster raises RayAddressError (orchestrator.cluster.address), before any wait."""
    source = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        check_address(address, source)
        try:
            ray.init(address=address, log_to_driver=True, logging_level="WARNING")
        except (ConnectionError, ValueError) as err:
            raise unreachable(address, source, err) from err
        return RayConnection(False, ray.util.get_node_ip_address(), {})
    cpus = max(os.cpu_count() or 1, int(cpus_needed + 0.999))
    # address="local": never join a cluster some `ray start` left recorded in /tmp/ray.
    ray.init(address="local", num_cpus=cpus, num_gpus=None if gpus_needed else 0, include_dashboard=False,
             log_to_driver=True, logging_level="WARNING")
    # One machine: keep rank-to-rank and rank-to-controller traffic on loopback.
    return RayConnection(True, "127.0.0.1", {"GLOO_SOCKET_IFNAME": "lo"})


def alive_node_resources() -> list[dict[str, float]]:
    """Each alive node's total Ray resources (what it could ever give one bundle)."""
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
