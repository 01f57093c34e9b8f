"""A local multi-node Ray cluster for the failure tests: one head and N worker nodes on this machine.

Built on `ray.cluster_utils.Cluster` (what Ray's own tests use): every node is a separate
raylet with its own ports and object store, so killing one is losing a node as Ray sees it.
The head runs no ranks (0 CPUs): the controller lives there, and a node kill never takes the
controller down. Each worker node offers `cpus_per_node` CPUs and the same number of the
custom resource `undying_slot`, which the test jobs request. Nodes are stopped by the PIDs
of their processes (never `ray stop`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile

SLOT = "undying_slot"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ports() -> dict:
    # Agents bind fixed default ports unless told otherwise; pick free ones per node.
    return {"dashboard_agent_listen_port": _free_port(), "metrics_export_port": _free_port(),
            "runtime_env_agent_port": _free_port()}


class LocalCluster:
    def __init__(self, nodes: int = 3, cpus_per_node: int = 2):
        from ray.cluster_utils import Cluster

        self.cpus_per_node = cpus_per_node
        self.temp_dir = tempfile.mkdtemp(prefix="rmn-", dir="/tmp")  # short: socket paths have a limit
        self.cluster = Cluster(initialize_head=False, shutdown_at_exit=False)
        self._start(lambda: self.cluster.add_node(
            num_cpus=0, gcs_server_port=_free_port(), temp_dir=self.temp_dir, include_dashboard=False, **_ports(),
            # Ray re-places a lost node's placement-group bundles once the GCS declares the node
            # dead; a 1 s health check (default 3 s x 5) keeps the grow-back tests short. The
            # controller's own node-loss detection does not depend on it.
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 5}))
        self.nodes = [self.add_node() for _ in range(nodes)]

    def _start(self, start, attempts: int = 3):
        """Start a node, retrying: Ray gives a raylet a fixed 30 s to register, which a loaded
        2-core machine can miss. A failed attempt's processes are found by our temp dir and
        killed by PID."""
        for attempt in range(attempts):
            known = {pid for node in self._all_nodes() for pid in self.node_pids(node)}
            try:
                return start()
            except Exception:
                for pid in self._pids_under_temp_dir() - known:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if attempt == attempts - 1:
                    raise

    def _all_nodes(self) -> list:
        return [n for n in [self.cluster.head_node, *self.cluster.worker_nodes] if n is not None]

    def _pids_under_temp_dir(self) -> set[int]:
        marker = self.temp_dir.encode()
        found = set()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        if marker in handle.read():
                            found.add(int(entry))
                except OSError:
                    continue
        return found

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self):
        return self._start(lambda: self.cluster.add_node(
            num_cpus=self.cpus_per_node, resources={SLOT: self.cpus_per_node}, **_ports()))

    def node_pids(self, node) -> list[int]:
        return [info.process.pid for infos in node.all_processes.values() for info in infos]

    def rank_pids(self, node) -> list[int]:
        """PIDs of rank actors running on `node` (children of its raylet)."""
        from chaos.injector import children_of

        out = []
        for pid in sorted(children_of(node.all_processes["raylet"][0].process.pid)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if b"RankActor" in handle.read():
                        out.append(pid)
            except OSError:
                continue
        return out

    def reap_lost_nodes(self) -> int:
        """Stop what is left of nodes whose raylet died (a kill_node fault); returns how many."""
        lost = [n for n in self.cluster.worker_nodes if n.all_processes["raylet"][0].process.poll() is not None]
        for node in lost:
            self.cluster.remove_node(node, allow_graceful=False)
            self.nodes.remove(node)
        return len(lost)

    def restore(self, count: int) -> None:
        """Bring the cluster back to `count` live worker nodes."""
        self.reap_lost_nodes()
        while len(self.nodes) < count:
            self.nodes.append(self.add_node())

    def shutdown(self) -> None:
        pids = [pid for node in self._all_nodes() for pid in self.node_pids(node)]
        pids += sorted(self._pids_under_temp_dir())
        try:
            self.cluster.shutdown()
        finally:
            for pid in pids:  # whatever survived a graceful stop
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
