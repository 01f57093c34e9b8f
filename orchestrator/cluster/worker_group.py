"""The ranks of a job as Ray actors in a placement group: create, call, watch, replace.

Protocol: the controller is the only caller, from one thread. `place` reserves the bundles of
the placement plan (orchestrator/cluster/placement.py: one bundle per TP group, so a group
always shares a node; one seat per rank or spare), failing fast when the cluster can never
satisfy it; `ensure_actors` creates the actors of the given ranks in their seats; the `*_all`
methods fan a call out and wait; `start_training` launches every rank's `train` call and
`wait_any` reports finished or dead ranks. A SIGKILLed actor is seen through its pending
`train` call (Ray raises `ActorDiedError` within milliseconds): nothing polls the processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chaos.config import ArmedFault
from ckpt.staging import staging_env
from ckpt.storage_options import error_reason
from orchestrator.cluster import interruptible, stale_groups
from orchestrator.cluster.capacity import capacity_problems, node_problems
from orchestrator.cluster.new_actors import RANK_GONE, pings_within
from orchestrator.cluster.placement import SeatChoice, choose_seats, plan_placement
from orchestrator.cluster.placement_error import PlacementError
from orchestrator.cluster.ray_cluster import alive_node_resources
from orchestrator.cluster.shared_root import RootNotShared, root_proof
from orchestrator.cluster.spare_seats import SpareSeats
from orchestrator.rank.actor import RankActor
from orchestrator.wire.auth import StoreAddress

log = logging.getLogger(__name__)

HELD_PROBE_S = 5.0  # how long a restore's choice waits for the holders to say what they hold


@dataclass
class RankOutcome:
    rank: int
    status: str  # "done" | "aborted" | "died"
    info: dict


class RayWorkerGroup(SpareSeats):
    """Rank actors and warm spares, each pinned to one seat of the job's placement group.

    A seat is one rank's share of a bundle (a TP group's bundle has tp seats). `actors[rank]`
    is the actor that plays `rank` in the current generation; `bundle_of[rank]` its seat.
    Spares are actors that have started (torch imported) but hold no rank; a failed rank is
    replaced by a spare in milliseconds instead of a cold actor in seconds (the spares' methods:
    orchestrator/cluster/spare_seats.py).
    """

    def __init__(self, spec, env_vars: dict[str, str] | None = None, placement_timeout_s: float = 60.0):
        self.spec = spec
        self.spec_json = spec.model_dump_json(by_alias=True)
        # The rank processes' environment, fixed when Ray starts them: the connection's settings
        # plus glibc's streaming-copy threshold for checkpoint staging (ckpt.staging.staging_env).
        self.env_vars = {**staging_env(os.environ), **(env_vars or {})}
        self.placement_timeout_s = placement_timeout_s
        # The controller's "is the job ending?": long waits give up when it says yes (cluster.interruptible).
        self.interrupted = interruptible.never
        self.pg = None
        # seat -> Ray bundle index; every `bundle` index below (bundle_of, spares) is a seat index
        self.seat_bundle: list[int] = []
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.bundle_of: dict[int, int] = {}
        self.spares: dict[int, tuple[ray.actor.ActorHandle, ray.ObjectRef]] = {}  # bundle -> (actor, ping)
        self.silent_spares: dict[str, int] = {}  # spare actor id -> live_ready_spares' asks in a row unanswered
        self._train_refs: dict[ray.ObjectRef, int] = {}
        self._remote = ray.remote(RankActor)
        self.node_of_actor: dict[str, str] = {}  # actor id -> node id, from the actors' own pings
        self.lost_nodes: set[str] = set()
        self.root_proof = root_proof(spec)  # every actor checks, as it starts, that it sees the root

    def place(self, world_size: int, spares: int = 0,
              on_wait: Callable[[float], object] = lambda seconds: None) -> None:
        """Reserve the seats of `world_size` ranks and `spares` spares (a placement group); PlacementError when
        the cluster cannot hold them, or does not grant them within resources.placement_timeout_s. `on_wait`
        gets the seconds it waited for the grant, whatever the outcome (the cluster's capacity, not the job's)."""
        problems = capacity_problems(self.spec, ray.cluster_resources())
        problems = problems or node_problems(self.spec, alive_node_resources())
        if problems:
            raise PlacementError("; ".join(str(p) for p in problems))
        plan = plan_placement(world_size, self.spec.parallel.tp, spares, self.spec.resources,
                              self.spec.resources.placement)
        name = stale_groups.group_name(self.spec.checkpoint_root)
        if removed := stale_groups.remove_stale(name):  # a fenced driver's of this root (cluster.stale_groups)
            log.warning("removed %d placement group(s) a former driver of %s left on the cluster (it lost the "
                        "root's lease while alive); its rank actors end with them", removed, self.spec.checkpoint_root)
        self.pg = placement_group(plan.bundles, strategy=plan.strategy, name=name)
        self.seat_bundle = plan.seat_bundle
        began = time.perf_counter()
        try:
            ready, _ = interruptible.wait([self.pg.ready()], 1, self.placement_timeout_s, self.interrupted)
        finally:  # granted, timed out or cut short by a signal: the cluster's capacity kept the job waiting
            on_wait(time.perf_counter() - began)
        if not ready:
            raise PlacementError(f"{len(plan.bundles)} bundles ({plan.bundles[0]} for each TP group) could not be "
                                 f"placed within {self.placement_timeout_s:.0f} s")
        self.bundle_of = {rank: rank for rank in range(world_size)}

    def _new_actor(self, seat: int):
        res = self.spec.resources
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=self.seat_bundle[seat])
        return self._remote.options(
            num_cpus=res.cpus_per_rank, num_gpus=res.gpus_per_rank, resources=res.custom or None,
            max_concurrency=8, max_restarts=0, scheduling_strategy=strategy,
            runtime_env={"env_vars": self.env_vars} if self.env_vars else None,
        ).remote(self.spec_json, self.root_proof)

    def ensure_actors(self, ranks: list[int]) -> None:
        """Create cold actors for `ranks` in their own bundles (no waiting)."""
        for rank in ranks:
            self.actors[rank] = self._new_actor(self.bundle_of[rank])

    def free_bundles(self) -> list[int]:
        """Bundles holding no rank and no spare, and not placed on a node known to be lost.

        A bundle on a lost node comes back once Ray re-places it on a live node (after the
        GCS declares the node dead and capacity exists), so this is re-read every time.
        """
        used = set(self.bundle_of.values()) | set(self.spares)
        on_lost = set(self._bundles_on(self.lost_nodes))
        return [b for b in range(len(self.seat_bundle)) if b not in used and b not in on_lost]

    def _bundles_on(self, nodes: set[str]) -> list[int]:
        if not nodes or self.pg is None:
            return []
        table = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {})
        lost = {int(b) for b, node in table.items() if node in nodes}
        return [seat for seat, bundle in enumerate(self.seat_bundle) if bundle in lost]

    def _remember_node(self, actor, info) -> None:
        """Keep the node an actor's ping names; RootNotShared when it does not see the checkpoint root."""
        if isinstance(info, dict) and info.get("node"):
            self.node_of_actor[actor._actor_id.hex()] = info["node"]
        if isinstance(info, dict) and info.get("sees_root") is False:
            raise RootNotShared(self.spec.checkpoint_root, str(info.get("node", "?")), self.root_proof[0])

    def node_of(self, rank: int) -> str | None:
        actor = self.actors.get(rank)
        return None if actor is None else self.node_of_actor.get(actor._actor_id.hex())

    def inject(self, rank: int, fault: ArmedFault):
        """Fire a chaos fault on `rank` now (no waiting: a killed rank never answers); the call's ref, for
        `injection_error`, or None when the job has no such rank."""
        return self.actors[rank].inject.remote(fault) if rank in self.actors else None

    @staticmethod
    def injection_error(ref) -> str | None:
        """Why an `inject` call failed, once it has ended; None while it runs or when it returned. (A kill
        that fired ends the call with the actor's death too: its fault notice tells the two apart.)"""
        if not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            ray.get(ref)
        except Exception as err:  # noqa: BLE001 (the actor's refusal, or its death)
            return error_reason(err)
        return None

    def controller_node(self) -> str:
        """The node this process (the controller, a Ray driver) runs on."""
        return ray.get_runtime_context().get_node_id()

    def forget_node(self, node: str) -> list[int]:
        """A node is lost (its raylet died): kill and drop every rank and spare on it.

        Their processes exit by themselves (RankActor's node watchdog); nobody waits for Ray
        to notice. Returns the ranks that were on the node.
        """
        self.lost_nodes.add(node)
        ranks = [r for r in sorted(self.actors) if self.node_of(r) == node]
        for rank in ranks:
            self.kill(rank)
        self.drop_spares_on({node})
        return ranks

    def nodes_in_use(self) -> set[str]:
        """The nodes known to hold a rank or a spare, lost ones aside."""
        return {self.node_of_actor.get(actor_id) for actor_id in self.live_actors()} - self.lost_nodes - {None}

    def stranded(self, ranks: list[int], draining: set[str]) -> list[int]:
        """Of `ranks` about to get new actors, those `replace_cold` could seat only on a node
        in `draining` (placement.choose_seats): Ray starts nothing there until the node has gone."""
        return self._seat_choice(ranks, draining).stranded

    def _seat_choice(self, ranks: list[int], draining: set[str]) -> SeatChoice:
        return choose_seats(ranks, self.bundle_of, self.free_bundles(), set(self._bundles_on(self.lost_nodes)),
                            set(self._bundles_on(draining)))

    def replace_cold(self, ranks: list[int], timeout_s: float, draining: set[str] = frozenset()) -> list[int]:
        """New actors for `ranks`, each in its own seat when that is on a live node not being drained
        (beside its TP group), else in a free seat (placement.choose_seats); returns ranks not up
        within `timeout_s` (new_actors.pings_within: one that dies starting is created again)."""
        seats = self._seat_choice(ranks, draining).seats
        for rank in ranks:
            self.bundle_of[rank] = seats[rank]
            self.actors[rank] = self._new_actor(seats[rank])
        up = pings_within(ranks, self.actors.__getitem__, self._recreate, timeout_s, self.interrupted)
        for rank, ping in up.items():
            self._remember_node(self.actors[rank], ping)
        late = [r for r in ranks if r not in up]
        for rank in late:
            # Keep the pending actor as a spare-to-be: when resources return it starts, and
            # the controller can grow back at a checkpoint boundary.
            actor = self.actors.pop(rank)
            self.spares[self.bundle_of.pop(rank)] = (actor, actor.warm_up.remote())
        return late

    def _recreate(self, rank: int) -> None:
        self.actors[rank] = self._new_actor(self.bundle_of[rank])

    def renumber(self, keep: list[int]) -> None:
        """Shrink: old rank keep[i] becomes rank i; any other live rank becomes a spare."""
        actors, bundles = {}, {}
        for new, old in enumerate(keep):
            actors[new], bundles[new] = self.actors[old], self.bundle_of[old]
        for old in set(self.actors) - set(keep):
            self.keep_as_spare(self.bundle_of[old], self.actors[old])
        self.actors, self.bundle_of = actors, bundles

    def _call_all(self, method: str, args_of, timeout_s: float) -> list:
        refs = [getattr(self.actors[r], method).remote(*args_of(r)) for r in sorted(self.actors)]
        return interruptible.get(refs, timeout_s, self.interrupted)

    def ping_all(self, timeout_s: float, restarts: int = 1) -> list[dict]:
        """Wait until every rank actor has started; returns their pings in rank order.

        An actor that dies while starting (a crash, or Ray's memory monitor killing it while the
        node is short of memory) is created again in its seat, up to `restarts` times, since no
        rank holds any state yet; one that is merely slow past `timeout_s` is an error."""
        ranks = sorted(self.actors)
        refs = {rank: self.actors[rank].ping.remote() for rank in ranks}
        pings: dict[int, dict] = {}
        for attempt in range(restarts + 1):
            deadline = time.monotonic() + timeout_s
            for rank, ref in list(refs.items()):
                try:
                    pings[rank] = interruptible.get([ref], deadline - time.monotonic(), self.interrupted)[0]
                except RANK_GONE:
                    if attempt == restarts:
                        raise
                    self._recreate(rank)
                    refs[rank] = self.actors[rank].ping.remote()
                    continue
                del refs[rank]
            if not refs:
                break
        for rank in ranks:
            self._remember_node(self.actors[rank], pings[rank])
        return [pings[rank] for rank in ranks]

    def join_all(self, gen: int, address: StoreAddress, timeout_s: float,
                 collective_timeout_s: float | None = None) -> list[float]:
        """Every rank joins generation `gen` of the store at `address` (which carries the job's
        secret to the actors as a call argument: through Ray, never a file or a log) within
        `timeout_s`; its process group's collectives time out after `collective_timeout_s`
        (default `timeout_s`)."""
        world = len(self.actors)
        collective = collective_timeout_s or timeout_s
        return self._call_all("join", lambda r: (gen, r, world, address, timeout_s, collective), timeout_s + 30)

    def restore_all(self, step: int | None, dp: int, timeout_s: float,
                    faults: list[ArmedFault] | None = None, source=None) -> list[dict]:
        """`source`: a memory snapshot (orchestrator.rank.snapshots.MemorySource) every rank loads
        instead of checkpoint `step`."""
        return self._call_all("restore", lambda r: (step, dp, faults, source), timeout_s)

    def start_training(self, until_step: int, faults: list[ArmedFault], buddies: dict | None = None,
                       eval_at: int | None = None) -> None:
        """`buddies`: rank -> the rank whose actor keeps a copy of its memory snapshots; `eval_at`: a
        validation the ranks owe at the restored step, run before their first (RankLoop.run)."""
        buddy = {r: self.actors[b] for r, b in (buddies or {}).items() if b is not None}
        self._train_refs = {self.actors[r].train.remote(until_step, faults, buddy.get(r), eval_at): r
                            for r in sorted(self.actors)}

    def live_actors(self) -> dict[str, ray.actor.ActorHandle]:
        """Actor id -> handle of every rank and spare not known dead (holders of memory snapshots)."""
        handles = [*self.actors.values(), *(actor for actor, _ in self.spares.values())]
        return {actor._actor_id.hex(): actor for actor in handles}

    def held_files(self, timeout_s: float = HELD_PROBE_S) -> dict[str, set[str]]:
        """Actor id -> the memory snapshot shards each live rank and spare holds now (`RankActor.held_files`),
        asked of all at once; one that died holds none, one that does not answer within `timeout_s` is
        left out (not known: its liveness alone counts, and a read from it that fails discards the
        snapshot as before)."""
        live = self.live_actors()
        refs = {actor_id: actor.held_files.remote() for actor_id, actor in live.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out: dict[str, set[str]] = {}
        for actor_id, ref in refs.items():
            if ref in ready:
                out[actor_id] = set()
                with contextlib.suppress(ray.exceptions.RayError):
                    out[actor_id] = set(ray.get(ref))
        return out

    def wait_any(self, timeout_s: float) -> list[RankOutcome]:
        if not self._train_refs:
            return []
        ready, _ = ray.wait(list(self._train_refs), num_returns=len(self._train_refs), timeout=timeout_s)
        outcomes = []
        for ref in ready:
            rank = self._train_refs.pop(ref)
            try:
                info = ray.get(ref)
                outcomes.append(RankOutcome(rank, info["status"], info))
            except RANK_GONE as err:
                actor = self.actors.pop(rank, None)  # gone for good (max_restarts=0); the controller replaces it
                if actor is not None:
                    # Make sure its process is gone too: ActorUnavailableError is a RayActorError that
                    # means unreachable now, not dead, and a buddy's handle would keep it (and its GPU) alive.
                    ray.kill(actor, no_restart=True)
                outcomes.append(RankOutcome(rank, "died", {"error": str(err).splitlines()[0]}))
        return outcomes

    def running(self) -> list[int]:
        return sorted(self._train_refs.values())

    def kill(self, rank: int) -> None:
        actor = self.actors.pop(rank, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        for ref, r in list(self._train_refs.items()):
            if r == rank:
                del self._train_refs[ref]

    def kill_actor_only(self, rank: int) -> None:
        """Kill a rank's process but keep watching its pending call, which then reports it dead."""
        if rank in self.actors:
            ray.kill(self.actors[rank], no_restart=True)

    def leave_all(self, ranks: list[int], timeout_s: float) -> list[int]:
        """Ask live ranks to drop their process group; returns ranks that did not answer, whose node
        is gone (their raylet died: the process may answer but must not be trusted), or whose restore
        of the generation left is stuck in a read: still inside after half of `timeout_s`, with no progress
        for minutes (RankActor.leave)."""
        refs = {self.actors[r].leave.remote(timeout_s / 2): r for r in ranks if r in self.actors}
        deadline = time.monotonic() + timeout_s
        lost = []
        for ref, rank in refs.items():
            try:
                if not interruptible.get([ref], deadline - time.monotonic(), self.interrupted)[0]:
                    lost.append(rank)
            except (GetTimeoutError, *RANK_GONE):
                lost.append(rank)
        return lost

    def shutdown(self) -> None:
        """Kill every rank and spare and give the placement group back. Each step is tried even
        when one before it failed (a GCS that stopped answering), so one error leaves no
        reservation behind that could be freed; the first error is raised at the end."""
        steps = [lambda rank=rank: self.kill(rank) for rank in list(self.actors)]
        steps += [lambda actor=actor: ray.kill(actor, no_restart=True) for actor, _ in self.spares.values()]
        if self.pg is not None:
            steps.append(lambda pg=self.pg: remove_placement_group(pg))
        self.spares.clear()
        self.pg = None
        first = None
        for step in steps:
            try:
                step()
            except Exception as err:  # noqa: BLE001 (the rest still run; the first is raised below)
                first = first or err
        if first is not None:
            raise first
