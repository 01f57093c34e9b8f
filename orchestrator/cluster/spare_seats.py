"""The warm spares of a job's worker group: start, watch, drop, and promote them to ranks.

Protocol: mixed into `RayWorkerGroup` (orchestrator/cluster/worker_group.py), whose state it
shares (`spares`: seat -> (actor, its warm-up call), `actors`, `bundle_of`, the node records);
the controller is the only caller, from one thread. `start_spares` fills every free seat (but those
on nodes it is told to avoid: draining ones);
`ready_spares` / `live_ready_spares` say which have warmed up (and, for the latter, still
answer); `promote_spares` hands ready spares to lost ranks (a recovery) or new ranks (a grow),
keeping each TP group on one node (placement.assign_spares); `drop_spares_on` kills those on
lost or draining nodes.
"""

from __future__ import annotations

from collections import Counter

import ray
from ray.exceptions import RayError

from orchestrator.cluster import interruptible
from orchestrator.cluster.placement import SpareChoice, assign_spares

SILENT_ASKS = 3  # a warm spare that answers none of this many asks in a row is hung: killed, its seat freed


class SpareSeats:
    """The spare half of `RayWorkerGroup` (see the module docstring)."""

    def drop_spares_on(self, nodes: set[str]) -> int:
        """Kill the spares on `nodes` (lost, or draining: a rank promoted there would have to move
        again), those still warming up too (by their seat's bundle: their own node is known only
        once warm); their seats are free. Returns how many."""
        seats = set(self._bundles_on(nodes))
        gone = [seat for seat in self.spares if seat in seats or self.spare_node(seat) in nodes]
        for seat in gone:
            ray.kill(self.spares.pop(seat)[0], no_restart=True)
        return len(gone)

    def spares_on(self, node: str) -> int:
        """How many spares are known to run on `node` (a spare's node is known once it warmed up)."""
        return sum(self.spare_node(seat) == node for seat in self.spares)

    def start_spares(self, avoid: set[str] = frozenset()) -> list[int]:
        """Start a spare in every free seat not on a node in `avoid` (draining: a rank promoted there
        would move again) without waiting, each warming up on its own; returns the seats."""
        away = set(self._bundles_on(set(avoid)))
        free = [seat for seat in self.free_bundles() if seat not in away]
        for bundle in free:
            actor = self._new_actor(bundle)
            self.spares[bundle] = (actor, actor.warm_up.remote())
        return free

    def spare_seats(self) -> list[int]:
        """Seats holding a spare, warm or still warming up."""
        return sorted(self.spares)

    def ready_spares(self) -> list[int]:
        """Bundles whose spare has started and warmed up (non-blocking)."""
        ready = []
        for bundle, (_, ping) in list(self.spares.items()):
            done, _ = ray.wait([ping], timeout=0)
            if not done:
                continue
            try:
                self._remember_node(self.spares[bundle][0], ray.get(ping))
            except RayError:  # died while idle, or its warm-up raised (a device error): its bundle is free again
                ray.kill(self.spares.pop(bundle)[0], no_restart=True)
                continue
            if self.spare_node(bundle) in self.lost_nodes:
                ray.kill(self.spares.pop(bundle)[0], no_restart=True)
                continue
            ready.append(bundle)
        return ready

    def await_spares(self, seats: list[int], count: int, timeout_s: float) -> None:
        """Block until `count` of the spares in `seats` have finished warming up (or died), or
        `timeout_s` has passed; `promote_spares` then takes the ready ones."""
        refs = [self.spares[seat][1] for seat in seats if seat in self.spares]
        if refs and timeout_s > 0:
            interruptible.wait(refs, min(count, len(refs)), timeout_s, self.interrupted)

    def live_ready_spares(self, timeout_s: float = 2.0) -> list[int]:
        """`ready_spares`, each asked once more whether it is alive: a spare that warmed up and then
        died idle (Ray's memory monitor, a crash, its node lost) still shows its warm-up answer, which
        Ray keeps. One round trip for all; a spare that does not answer in `timeout_s` is left out this
        time (a loaded machine's slow answer is no proof; one that died is dropped), and one that answers
        none of SILENT_ASKS asks in a row is hung (SIGSTOPped, wedged): killed, so its seat takes a new
        spare instead of costing every promotion and every grow's count its timeout for the rest of the job."""
        ready = self.ready_spares()
        pings = {self.spares[bundle][0].ping.remote(): bundle for bundle in ready}
        answered, _ = interruptible.wait(list(pings), len(pings), timeout_s, self.interrupted) if pings else ([], [])
        alive = []
        for ref in answered:
            try:
                ray.get(ref)
                alive.append(pings[ref])
            except RayError:  # died while idle; its bundle is free again
                ray.kill(self.spares.pop(pings[ref])[0], no_restart=True)
        # Counted per actor, not per seat: the next spare in a seat starts from nothing.
        silent = {self.spares[b][0]._actor_id.hex(): b for b in pings.values() if b not in alive and b in self.spares}
        self.silent_spares = {actor: self.silent_spares.get(actor, 0) + 1 for actor in silent}
        for actor, bundle in silent.items():
            if self.silent_spares[actor] >= SILENT_ASKS:
                ray.kill(self.spares.pop(bundle)[0], no_restart=True)
        return sorted(alive)

    def promote_spares(self, ranks: list[int]) -> SpareChoice:
        """Give ready spares (alive now) to `ranks`, each TP group on one node (placement.assign_spares:
        a group whose node has too few spares moves whole onto another node's, its live ranks
        becoming spares in their seats); the choice's `left` are the ranks no spare was given to."""
        ready = self.live_ready_spares()
        choice = assign_spares(ranks, self.spec.parallel.tp, {rank: self.node_of(rank) for rank in self.actors},
                               [(seat, self.spare_node(seat)) for seat in ready])
        retired = [(self.actors.pop(rank), self.bundle_of.pop(rank)) for rank in choice.moved]
        for rank, seat in choice.seats.items():
            self.actors[rank], self.bundle_of[rank] = self.spares.pop(seat)[0], seat
        for actor, seat in retired:
            self.keep_as_spare(seat, actor)
        return choice

    def keep_as_spare(self, seat: int, actor) -> None:
        """A live rank's process, out of its generation (it left), becomes the spare of its seat: it
        paid its imports and first step long ago, so a ping stands for the warm-up call."""
        self.spares[seat] = (actor, actor.ping.remote())

    def spare_node(self, seat: int) -> str | None:
        """The node of the spare in `seat`, once it has warmed up (None before)."""
        return self.node_of_actor.get(self.spares[seat][0]._actor_id.hex())

    def promotable_spares(self) -> int:
        """How many live ready spares a grow can use: whole TP groups' worth on each node (`grow`
        never splits a group over nodes either)."""
        tp = self.spec.parallel.tp
        per_node = Counter(self.spare_node(seat) for seat in self.live_ready_spares())
        return sum(count - count % tp for count in per_node.values())

    def grow(self, world_size: int) -> list[int]:
        """Promote ready spares to ranks len(actors)..world_size-1; returns the new ranks."""
        new = list(range(len(self.actors), world_size))
        missing = self.promote_spares(new).left
        return [r for r in new if r not in missing]
