"""Getting ranks out of a generation and deciding the next one's membership.

Recovery, in order (docs/design.md section 2), as the controller's RECOVERING state runs it:
  1. Detection (before RECOVERING): a rank's pending `train` call raised (dead actor) or
     returned "aborted" (its collective failed), a node watchdog reported its raylet gone, or
     the progress watchdog fired (no step for k x median) (orchestrator.controller.blame).
  2. Release (`release`): the abort key is set in the generation's store; every live rank's
     watcher breaks its own collectives (orchestrator.rank.comm_abort), so survivors are out
     within milliseconds; a rank not out within `release_timeout_s` (a hung process) is killed.
     The job's nodes are probed first (orchestrator.cluster.node_probe): a gone node's
     ranks and spares are dropped at once, as a reported node loss's are, not waited on.
  3. Accounting (the controller): time from the fault to its detection is `detection`;
     compute of steps after the restore point is `lost_work` (it will be redone).
  4. Decision: the failure policy says restart or fail (budget, crash loop).
  5. Membership (`replace`): lost ranks are taken over by warm spares, else by new actors
     that must start within `elastic.replace_timeout_s`, else data parallelism shrinks to the
     largest valid degree (the scaling policy). Survivors keep their processes. The spare
     pool is refilled in the background once training runs again (orchestrator.controller.spare_pool).
Growing back is the same path without a failure (`grow_to`, then `stop_generation`): at a
checkpoint commit, when warm spares could raise dp towards its target (those on a draining node
dropped first), the generation is stopped and re-formed larger. Controller thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from orchestrator.cluster import node_probe
from orchestrator.cluster.interruptible import Interrupted
from orchestrator.cluster.placement import SpareChoice, split_tp_groups, tp_runs_by_node
from orchestrator.controller.errors import collapse
from orchestrator.controller.policies import ScalingPolicy
from orchestrator.controller.spare_pool import SparePool


@dataclass(frozen=True)
class Released:
    dead: list[int]  # ranks whose actors died (in the failure or while waiting)
    stuck: list[int]  # ranks killed because they did not leave in time (hung)
    lost: list[int]  # ranks that need a new actor
    crashed: dict[str, list[int]] = field(default_factory=dict)  # nodes the probe found gone -> their ranks


@dataclass(frozen=True)
class Membership:
    """The next generation's data-parallel degree, in words for the log; `error` when none is possible."""

    dp: int
    words: str
    error: str | None = None


class Recovery:
    def __init__(self, spec, workers, scaling_policy: ScalingPolicy, log: Callable[[str], None], *,
                 release_timeout_s: float | Callable[[], float], poll_s: float, metrics,
                 draining: Callable[[], Iterable[str]] = tuple,
                 probe: Callable[[Iterable[str]], list[str]] = node_probe.lost_nodes):
        self.spec = spec
        self.workers = workers
        self.spares = SparePool(spec, workers, metrics, log, draining=draining)
        self.scaling_policy = scaling_policy
        self.log = log
        # A callable: the controller's limit now (orchestrator.controller.timeouts, it follows the step time).
        self._release_s = release_timeout_s if callable(release_timeout_s) else lambda: release_timeout_s
        self.poll_s = poll_s
        self.draining = draining  # the nodes Ray is draining now (orchestrator.cluster.drain)
        self.probe = probe  # of the nodes given, those whose raylet is gone (orchestrator.cluster.node_probe)

    @property
    def release_timeout_s(self) -> float:
        return self._release_s()

    def model_parallel(self) -> int:
        return self.spec.parallel.tp * self.spec.parallel.pp

    def release(self, store, world_size: int, errors: dict[int, str], intake) -> Released:
        """Get every rank out of the old generation. `errors` (rank -> error) gains what the
        release learns: the ranks of lost nodes, and the outcome of every rank that finished.
        `intake` (the controller's EventIntake) is drained after the wait: a node whose loss is
        reported meanwhile is dropped here too, not left to fail the next generation. A node the
        probe finds gone is dropped like a reported one (its late report ignored) and returned in
        `Released.crashed`."""
        store.request_abort()
        self._forget(intake.take_lost_nodes(), errors)
        crashed = self._forget(self.probe(self.workers.nodes_in_use()), errors, "its raylet is gone")
        intake.nodes_handled.update(crashed)
        finished, stuck = self.wait_out()
        intake.drain(store)  # late receipts may still complete a checkpoint; late node losses
        self._forget(intake.take_lost_nodes(), errors)
        for rank, (outcome, _) in finished.items():
            errors.setdefault(rank, outcome.info.get("error", outcome.status))
        # Died in the trigger or while we waited: their actors are gone (stuck ones never finished).
        dead = [r for r in errors if r not in self.workers.actors]
        survivors = [r for r in range(world_size) if r in self.workers.actors]
        silent = self.workers.leave_all(survivors, timeout_s=self.release_timeout_s)
        for rank in silent:
            self.workers.kill(rank)
        stuck_all = sorted(set(stuck) | set(silent))
        slowest = max((seconds for _, seconds in finished.values()), default=0.0)
        self.log(f"release: {len(finished)} rank(s) out within {slowest * 1000:.0f} ms"
                 + (f"; killed {stuck_all} (not out within {self.release_timeout_s:.0f} s)" if stuck_all else "")
                 + (f"; errors {collapse(errors)}" if errors else ""))
        return Released(sorted(set(dead)), stuck_all, [r for r in range(world_size) if r not in self.workers.actors],
                        crashed)

    def _forget(self, nodes: list[str], errors: dict[int, str], why: str = "reported") -> dict[str, list[int]]:
        """Drop every rank and spare on `nodes` without waiting for Ray to notice (it takes 12-15 s);
        returns each node's ranks."""
        dropped = {}
        for node in nodes:
            ranks = dropped[node] = self.workers.forget_node(node)
            for rank in ranks:
                errors[rank] = f"node {node[:12]} lost"  # the cause, over what its death looked like
            self.log(f"node {node[:12]} lost ({why}): rank(s) {ranks} and its spares dropped")
        return dropped

    def replace(self, lost: list[int], dp: int) -> Membership:
        """Fill the lost ranks (spares, then new actors) or shrink dp."""
        if not lost:
            return Membership(dp, f"no rank lost, dp stays {dp}")
        draining = set(self.draining())
        if draining and self.workers.drop_spares_on(draining):  # a rank promoted there would move again
            self.log(f"spares on draining node(s) {', '.join(sorted(n[:12] for n in draining))} dropped")
        self.spares.watch(settled=False)  # a spare that just finished warming is said warm before it takes over
        promoted = self.workers.promote_spares(lost)
        cold, words = promoted.left, self._promotion_words(promoted, "warm spares")
        timeout_s, began = self.spec.elastic.replace_timeout_s, time.monotonic()
        if cold:  # at most half the limit: a spare that never warms leaves new actors the other half
            cold = self._await_warming_spares(cold, timeout_s / 2, words)
        stranded = self._stranded(cold, draining, words) if draining and cold else []
        cold = [r for r in cold if r not in stranded]
        # One limit for the whole replacement: new actors get what the wait for warming spares left.
        left_s = max(0.0, timeout_s - (time.monotonic() - began))
        waited = self.workers.replace_cold(cold, left_s, draining) if cold else []
        if cold and len(waited) < len(cold):
            words.append(f"rank(s) {sorted(set(cold) - set(waited))} replaced by new actors")
        if stranded or waited:
            alive = sorted(self.workers.actors)
            new_dp = self.scaling_policy.best_dp(len(alive))
            if new_dp is None:
                return Membership(dp, "", f"{len(alive)} rank(s) left and no replacement within {timeout_s:.0f} s; "
                                          f"cannot shrink: {self.scaling_policy.no_dp_because(len(alive))}")
            words.append((f"no replacement for rank(s) {waited} within {timeout_s:.0f} s, " if waited else "")
                         + f"shrinking dp {dp} -> {new_dp} (grad accumulation absorbs it)")
            self.workers.renumber(self.ranks_to_keep(alive, new_dp, dp))
            dp = new_dp
        if self.spares.target or dp < self.spec.parallel.dp:
            self.spares.refill_later(f"rank(s) {sorted(lost)} replaced")
        split = split_tp_groups(self.spec.parallel.tp, len(self.workers.actors), self.workers.node_of)
        if split:  # a new actor in a free seat elsewhere (its own on a lost node), or a shrink's gap-fill
            words.append(f"WARNING: TP group(s) {split} span nodes (their all-reduces cross the network)")
        return Membership(dp, "; ".join(words) or f"dp stays {dp}")

    def _stranded(self, cold: list[int], draining: set[str], words: list[str]) -> list[int]:
        """Of the `cold` ranks, those left without a new actor: the only seats for them are on a node
        Ray is draining, which starts no actor until it has gone (a wait of up to its deadline, or
        without end), so dp shrinks now instead, when it may; the seats come back once Ray re-places
        them, and `grow_to` grows onto them. When dp may not shrink, they wait for their seats."""
        stranded = self.workers.stranded(cold, draining)
        if not stranded:
            return []
        if self.scaling_policy.best_dp(len(self.workers.actors) + len(cold) - len(stranded)) is None:
            words.append(f"rank(s) {stranded} wait for a seat: theirs are on a draining node and no other is free "
                         f"(dp cannot shrink below elastic.min_dp={self.spec.elastic.min_dp})")
            return []
        words.append(f"rank(s) {stranded} not replaced: their seats are on a draining node, where Ray starts no "
                     "actor until it has gone, and no other seat is free")
        return stranded

    def _await_warming_spares(self, cold: list[int], timeout_s: float, words: list[str]) -> list[int]:
        """Give `cold` ranks the spares still warming up, waiting for them (SparePool.wait_for_warming_s)
        rather than starting new actors beside them; returns the ranks still without one."""
        wait_s = self.spares.wait_for_warming_s(timeout_s)
        if wait_s <= 0:
            return cold
        started = time.monotonic()
        self.workers.await_spares(sorted(self.spares.warming), len(cold), wait_s)
        self.spares.watch(settled=False)
        promoted = self.workers.promote_spares(cold)
        words += self._promotion_words(promoted, f"a spare that finished warming up {time.monotonic() - started:.1f} s "
                                                 "into the recovery")
        return promoted.left

    @staticmethod
    def _promotion_words(promoted: SpareChoice, by: str) -> list[str]:
        lost = sorted(set(promoted.seats) - set(promoted.moved))
        words = [f"rank(s) {lost} taken over by {by}"] if lost else []
        if promoted.moved:  # their node had too few spares for the lost ranks: the whole TP group moved
            words.append(f"live rank(s) {promoted.moved} moved with them to keep their TP group on one node "
                         "(their processes are spares now)")
        return words

    def ranks_to_keep(self, alive: list[int], new_dp: int, dp: int) -> list[int]:
        """The `new_dp` x tp x pp live ranks that form the smaller job, in their new rank order.

        Whole model-parallel groups (the tp x pp ranks of one dp replica; under HSDP the
        dp / dp_replicate such groups of one replica, consecutive ranks) come first, so that TP
        groups and HSDP shard groups stay on the nodes they were placed on; gaps are filled with
        other live ranks, a TP group's worth from one node at a time where they can (a group that
        spans nodes would slow every step)."""
        group = self.model_parallel()
        unit = group * self.spec.parallel.dp_unit
        whole = [r for start in range(0, dp * group, unit)
                 if all(m in alive for m in range(start, start + unit)) for r in range(start, start + unit)]
        rest = tp_runs_by_node([r for r in alive if r not in whole], self.spec.parallel.tp, self.workers.node_of)
        return (whole + rest)[:new_dp * group]

    def grow_to(self, dp: int, world_size: int) -> tuple[int, int] | None:
        """At a checkpoint commit: (new dp, ready spares) when warm spares let dp grow, else None.

        Seats that were on a lost node come back when Ray re-places their bundles (the GCS declared
        the node dead and another node has room, or a node joined): the pool refills them here, at
        every commit, so that the job keeps its spares and a later commit can grow onto them."""
        if self.spares.target or dp < self.spec.parallel.dp:
            self.spares.refill(f"at a commit, seat(s) free again (dp {dp})")
        if dp >= self.spec.parallel.dp or not self.spec.elastic.grow:
            return None
        draining = set(self.draining())
        if draining and self.workers.drop_spares_on(draining):  # a rank grown there would move again at once
            self.log(f"spares on draining node(s) {', '.join(sorted(n[:12] for n in draining))} dropped")
        ready = self.workers.promotable_spares()  # live ones (a grow stops the generation), whole TP groups
        new_dp = self.scaling_policy.best_dp(world_size + ready)
        if new_dp is None or new_dp <= dp:
            return None
        return new_dp, ready

    def stop_generation(self, store, world_size: int) -> list[int]:
        """Every rank out of a healthy generation (growing back, a drain), its actors kept; returns the
        ranks gone meanwhile (died, or killed for not leaving), whose seats must be filled first."""
        store.request_abort()
        self.wait_out()
        survivors = [r for r in range(world_size) if r in self.workers.actors]
        for rank in self.workers.leave_all(survivors, timeout_s=self.release_timeout_s):
            self.workers.kill(rank)
        return [r for r in range(world_size) if r not in self.workers.actors]

    def wait_out(self) -> tuple[dict, list[int]]:
        """After the abort key is set: wait up to `release_timeout_s` for every running rank's
        `train` call, then kill the ranks still inside it (hung). Returns each finished rank's
        (outcome, seconds since the wait began) and the killed ranks; Interrupted when the job is
        ending meanwhile (the teardown kills what still runs)."""
        started, limit = time.monotonic(), self.release_timeout_s
        finished: dict = {}
        while self.workers.running() and time.monotonic() - started < limit:
            for outcome in self.workers.wait_any(self.poll_s):
                finished[outcome.rank] = (outcome, time.monotonic() - started)
            if self.workers.interrupted():  # twice the median step may outlast a pod's grace
                raise Interrupted("the job is ending")
        stuck = self.workers.running()
        for rank in stuck:
            self.workers.kill(rank)
        return finished, stuck
