"""The ranks of a job as Ray actors in a placement group: create, call, watch, replace.

Protocol: the controller is the only caller, from one thread. `place` reserves one bundle
per rank (failing fast when the cluster can never satisfy it); `ensure_actors` creates
the actors of the given ranks in their bundles; the `*_all` methods fan a call out and wait;
`start_training` launches every rank's `train` call and `wait_any` reports finished or dead
ranks. A SIGKILLed actor is seen through its pending `train` call: Ray raises
`ActorDiedError` within milliseconds, so no polling of the dead process is needed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestrator.rank_actor import RankActor


class PlacementError(RuntimeError):
    """The cluster cannot place the job's ranks (fatal: retrying will not help)."""


@dataclass
class RankOutcome:
    rank: int
    status: str  # "done" | "aborted" | "died"
    info: dict


class RayWorkerGroup:
    def __init__(self, spec, env_vars: dict[str, str] | None = None, placement_timeout_s: float = 60.0):
        self.spec = spec
        self.spec_json = spec.model_dump_json(by_alias=True)
        self.env_vars = env_vars or {}
        self.placement_timeout_s = placement_timeout_s
        self.pg = None
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self._train_refs: dict[ray.ObjectRef, int] = {}

    def _bundle(self) -> dict[str, float]:
        res = self.spec.resources
        bundle = {"CPU": res.cpus_per_rank, **res.custom}
        if res.gpus_per_rank:
            bundle["GPU"] = res.gpus_per_rank
        return bundle

    def place(self, world_size: int) -> None:
        bundle = self._bundle()
        total = ray.cluster_resources()
        for key, amount in bundle.items():
            need = amount * world_size
            if total.get(key, 0) < need:
                raise PlacementError(
                    f"the cluster has {total.get(key, 0):g} {key} but {world_size} ranks x {amount:g} = "
                    f"{need:g} are needed; lower resources.{_field(key)} or add nodes"
                )
        # PACK keeps ranks together (tensor-parallel groups must share a node); Ray spreads
        # what does not fit.
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise PlacementError(
                f"{world_size} bundles of {bundle} could not be placed within {self.placement_timeout_s:.0f} s"
            )

    def ensure_actors(self, ranks: list[int]) -> None:
        for rank in ranks:
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            res = self.spec.resources
            self.actors[rank] = ray.remote(RankActor).options(
                num_cpus=res.cpus_per_rank, num_gpus=res.gpus_per_rank, resources=res.custom or None,
                max_concurrency=4, max_restarts=0, scheduling_strategy=strategy,
                runtime_env={"env_vars": self.env_vars} if self.env_vars else None,
                name=None,
            ).remote(self.spec_json)

    def _call_all(self, method: str, args_of, timeout_s: float) -> list:
        refs = [getattr(self.actors[r], method).remote(*args_of(r)) for r in sorted(self.actors)]
        return ray.get(refs, timeout=timeout_s)

    def ping_all(self, timeout_s: float) -> list[dict]:
        return self._call_all("ping", lambda r: (), timeout_s)

    def join_all(self, gen: int, host: str, port: int, timeout_s: float) -> list[float]:
        world = len(self.actors)
        return self._call_all("join", lambda r: (gen, r, world, host, port, timeout_s), timeout_s + 30)

    def restore_all(self, step: int | None, timeout_s: float) -> list[dict]:
        return self._call_all("restore", lambda r: (step,), timeout_s)

    def start_training(self, until_step: int, faults: list[dict]) -> None:
        self._train_refs = {self.actors[r].train.remote(until_step, faults): r for r in sorted(self.actors)}

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
            except RayActorError as err:
                self.actors.pop(rank, None)  # gone for good (max_restarts=0); the controller replaces it
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

    def leave_all(self, ranks: list[int], timeout_s: float) -> list[int]:
        """Ask live ranks to drop their process group; returns ranks that did not answer."""
        refs = {self.actors[r].leave.remote(): r for r in ranks if r in self.actors}
        deadline = time.monotonic() + timeout_s
        silent = []
        for ref, rank in refs.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (GetTimeoutError, RayActorError):
                silent.append(rank)
        return silent

    def shutdown(self) -> None:
        for rank in list(self.actors):
            self.kill(rank)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _field(resource: str) -> str:
    return {"CPU": "cpus_per_rank", "GPU": "gpus_per_rank"}.get(resource, f"custom.{resource}")
