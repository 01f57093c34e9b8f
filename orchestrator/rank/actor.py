"""One training rank as a Ray actor: joins a generation, restores, trains autonomously.

Protocol (the controller calls, in this order, once per generation):
  1. `join(gen, rank, world_size, address, timeout_s, collective_timeout_s)`: connect to the
     controller's store (`address` carries the job's secret, which seals every control message:
     wire.auth), form the process group (gloo on CPU, nccl on GPU) under the generation's prefix over a
     store client of its own (aborted with it), timing out after elastic.collective_timeout_s.
  2. `restore(step, dp, faults, source)`: build the engine for the layout and load committed
     checkpoint `step` (None = fresh start), or the memory snapshot `source` when the controller
     chose the memory level (orchestrator.rank.snapshots).
  3. `train(until_step, faults, buddy)`: run steps with no per-step round trip to the controller;
     with the memory level on, snapshots go to this process's memory and to the `buddy` actor.
     Step records (rank 0), heartbeats and shard receipts go through the store. Returns
     `{"status": "done" | "aborted", ...}`; any error in a collective makes the rank tear
     down its process group at once, which cascades the error to peers blocked elsewhere
     in the ring, so nobody sits in a collective until its timeout.
  4. `leave()`: drop the process group; the process (and its imported torch) stays warm
     for the next generation, which is what makes re-forming take milliseconds.

The actor runs with several concurrency slots so `ping` answers while `train` runs, and so that
it keeps serving its held snapshot shards to peers (`hold_copy`, `read_held`) while it trains or
restores itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
import weakref
from datetime import timedelta

import ray

from chaos.config import ArmedFault
from ckpt.held import HeldShards
from ckpt.owner_claims import sees_claim
from orchestrator.rank.abort_watch import watch_abort
from orchestrator.rank.comm_abort import CommSockets
from orchestrator.rank.device import peak_flops_per_rank, require_cuda, torch_device
from orchestrator.rank.reclaim import reclaim_generation
from orchestrator.rank.restore_turns import STUCK_S, RestoreTurns
from orchestrator.wire.auth import StoreAddress
from orchestrator.wire.messages import NodeLost
from orchestrator.wire.store import GenerationStore, connect

# How often a rank checks that its node's raylet is alive, and the exit code when it is not.
log = logging.getLogger(__name__)
NODE_WATCH_S = 0.2
EXIT_NODE_LOST = 75


class RankActor:
    def __init__(self, spec_json: str, root_proof: tuple[str, str] | None = None):
        import torch

        from orchestrator.spec.job_spec import JobSpec

        torch.set_num_threads(1)  # many ranks share few cores in CPU set-ups
        self.spec = JobSpec.model_validate_json(spec_json)
        # Whether this node sees the driver's claim on a file:// root (orchestrator.cluster.shared_root):
        # looked at once, here, so that no ping (a liveness probe) waits on a slow mount.
        self.sees_root = root_proof is None or sees_claim(root_proof)
        self.store: GenerationStore | None = None
        self.watch_store: GenerationStore | None = None
        self.writer_store: GenerationStore | None = None
        self.snapshot_store: GenerationStore | None = None
        self.group_store: GenerationStore | None = None  # the process group's (join)
        # Memory snapshots this process holds (its own and its buddies'); they outlive generations.
        self.held = HeldShards(self.spec.name)
        self.engine = None
        self.mesh = None  # the generation's DeviceMesh (its join builds it; its teardown drops it)
        self.restores = RestoreTurns()  # one restore at a time, the latest winning
        self._reclaiming: threading.Thread | None = None  # a dropped engine's collection (_drop_engine)
        self._dropped: list[weakref.ref] = []  # engines and writers dropped, maybe still reachable (rank.reclaim)
        self._dropping = threading.Lock()  # `leave` and a stale restore may drop at once
        self.writer = None
        self.gen = -1
        self.rank = -1
        self.world_size = 0
        self.sockets: CommSockets | None = None
        self.collective_s: float | None = None  # the generation's collective timeout (join): its groups' too
        # Ray forks workers from the node's raylet: if our parent changes, the raylet died and
        # this node is lost, even though this process may still answer calls.
        self.raylet_pid = os.getppid()
        self.node_id = ray.get_runtime_context().get_node_id()
        self._rendezvous: tuple[StoreAddress, int] | None = None  # (address, gen) of the current store
        threading.Thread(target=self._watch_node, daemon=True, name="node-watchdog").start()
        self._abort = threading.Event()  # the controller asked this generation to stop

    def ping(self) -> dict:
        return {"pid": os.getpid(), "node": self.node_id, "gen": self.gen, "node_alive": self.node_alive(),
                "sees_root": self.sees_root}

    def node_alive(self) -> bool:
        return os.getppid() == self.raylet_pid

    def _watch_node(self) -> None:
        """Watchdog thread: when this node's raylet dies, tell the controller, then exit.

        A process whose raylet is gone may keep running and answering calls, but Ray can no
        longer manage it and declares the node dead only after its health checks time out
        (12-15 s by default). Reporting the loss through the controller's store takes well
        under a second; exiting at once makes the rank's peers fail fast instead of training
        on with a member nobody can trust.
        """
        while self.node_alive():
            time.sleep(NODE_WATCH_S)
        with contextlib.suppress(Exception):
            if self._rendezvous is not None:
                connect(*self._rendezvous, timeout_s=2.0).send(NodeLost(self.node_id, self.rank, time.time()))
        os._exit(EXIT_NODE_LOST)

    def inject(self, fault: ArmedFault) -> None:
        """Fire a time-triggered chaos fault now (the controller calls it when its time comes).

        Runs in one of the actor's spare concurrency slots, next to `train`. The fault event
        goes through a store connection of its own (clients are not shared between threads).
        """
        from chaos.injector import FaultInjector

        if self._rendezvous is None:  # no generation to tell: a kill now would be a failure nobody injected
            raise RuntimeError(f"chaos: {fault.kind} not fired: this actor has joined no generation")

        def notify(event: dict) -> None:
            connect(*self._rendezvous, timeout_s=5.0).send(event)

        step = self.engine.next_step if self.engine is not None else -1
        mine = fault.model_copy(update={"rank": self.rank})
        FaultInjector([mine], self.rank, notify).fire_now(mine, step)

    def warm_up(self) -> dict:
        """A spare's first call: import what taking over a rank runs (the engine, and the restore's
        and the training loop's modules, which the survivors imported long ago) and pay a first
        engine build and step (orchestrator.rank.warmup), so that the takeover costs milliseconds."""
        import torch._dynamo  # noqa: F401  (the engine's first deterministic-mode call imports it: ~1.4 s)

        import chaos.injector  # noqa: F401  (the import is the work)
        import ckpt.peer_storage  # noqa: F401
        import orchestrator.rank.loop  # noqa: F401
        import orchestrator.rank.snapshots  # noqa: F401
        import orchestrator.rank.state  # noqa: F401
        import trainer.engine  # noqa: F401
        import trainer.memory_probe  # noqa: F401
        import trainer.model  # noqa: F401
        from orchestrator.rank.warmup import warm_first_step

        # Measured once per process, at its first restore otherwise: on a spare that takes over
        # rank 0, a CPU's 0.3 s matmul probe would sit inside the recovery.
        peak_flops_per_rank(self.spec, torch_device(self.spec))
        warm_first_step(self.spec, torch_device(self.spec))
        reclaim_generation()  # the twin's engine; and a takeover's first collection scans little
        return self.ping()

    def join(self, gen: int, rank: int, world_size: int, address: StoreAddress, timeout_s: float,
             collective_timeout_s: float | None = None) -> float:
        import torch.distributed as dist

        from orchestrator.rank.state import generation_mesh

        started = time.perf_counter()
        self.leave()
        joining = self.restores.supersede()  # a `leave` from here on (the controller's release) supersedes it
        self.gen, self.rank, self.world_size = gen, rank, world_size
        self._rendezvous = (address, gen)
        self._abort = threading.Event()  # a new one: a late watcher of the last generation sets only its own
        self.store = connect(address, gen, timeout_s=timeout_s)
        # The watcher gets its own connection: a TCPStore client is not safe to share between
        # threads (interleaved requests on one socket can deadlock the training thread).
        self.watch_store = connect(address, gen, timeout_s=timeout_s)
        # And so does the checkpoint writer thread, for its receipts and fault notices.
        self.writer_store = connect(address, gen, timeout_s=timeout_s)
        # And the memory level's writer thread, for its snapshot receipts.
        self.snapshot_store = connect(address, gen, timeout_s=timeout_s)
        backend, bound = ("nccl" if self.spec.resources.gpus_per_rank > 0 else "gloo"), {}
        if backend == "nccl":
            import torch

            require_cuda(self.spec.resources.gpus_per_rank)
            # Ray shows a rank its one GPU as device 0. Bound before the group forms, so that NCCL's
            # communicators and a barrier use it rather than guess (torch warns when it must); and
            # given as the group's device, so that its communicator forms here, in the join the
            # controller times, and the mesh's sub-groups (built next, in the join too) split from it:
            # formed lazily at a first collective (in a restore, a first step), one a dead peer left
            # half made could not be aborted (orchestrator.rank.comm_abort), and its rank would hang.
            torch.cuda.set_device(0)
            bound = {"device_id": torch.device("cuda", 0)}
        self.collective_s = collective_timeout_s or timeout_s  # the mesh's groups (generation_mesh) take it too
        with CommSockets.capture() as self.sockets:
            # The group's own store client, inside the capture: `abort` shuts its socket too, so a wait in it (a
            # mesh's sub-group forming, a peer never coming) ends at once, not at the collective timeout.
            self.group_store = connect(address, gen, timeout_s=timeout_s)
            if self.restores.stale(joining):  # a leave came before `self.sockets` was this capture's: it shut nothing
                raise RuntimeError(f"rank {rank} was released while it joined generation {gen}")
            dist.init_process_group(
                backend, store=self.group_store.pg_store(), rank=rank, world_size=world_size,
                timeout=timedelta(seconds=self.collective_s), **bound,
            )
            self.mesh = generation_mesh(self.spec, world_size, self.collective_s)  # once: every restore's engine's
        return time.perf_counter() - started

    def hold_copy(self, relpath: str, data: bytes, gen: int) -> bool:
        """Keep a buddy's memory snapshot shard of generation `gen` (called by the owner's snapshot
        writer thread); False when this process already restored a later generation."""
        return self.held.put(relpath, data, gen)

    def read_held(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a held snapshot shard, for a rank restoring from memory."""
        return self.held.read_range(relpath, start, end)

    def held_files(self) -> list[str]:
        """The snapshot shards this process holds (`step-XXXXXX/FILE`), which the controller asks every
        holder before it chooses a snapshot to restore (orchestrator.cluster.worker_group.held_files)."""
        return self.held.files()

    def restore(self, step: int | None, dp: int, faults: list[ArmedFault] | None = None,
                source=None) -> dict:
        """Build the engine for data-parallel degree `dp` and load committed checkpoint `step`.

        `faults`: the chaos faults still armed; those of this rank at "during_restore" fire while
        the checkpoint loads, its storage faults with `op: read` disturb the loading's reads (their
        notices go through the generation's store, as in training). `source`: a memory snapshot
        (orchestrator.rank.snapshots.MemorySource) to load instead of `step`. The answer carries
        the bytes this restore read from durable storage (`storage_read_bytes`, counted by
        ckpt.storage on every read of this process)."""
        from ckpt.storage import durable_bytes_read
        from orchestrator.rank.state import build_engine
        from trainer.memory_probe import current_bytes, reset_peak_bytes

        ticket = self.restores.begin()  # a restore of this rank still running is stale from now on
        with self.restores.turn(ticket):  # and this one waits for it to give up: one engine at a time
            started, read_before = time.perf_counter(), durable_bytes_read()
            # Only the snapshot being restored stays held (peers may be reading it); older ones go.
            self.held.keep_only(source.files if source is not None else [], self.gen)
            self._drop_engine()  # drop the previous generation's engine before measuring the baseline
            device = torch_device(self.spec)
            self.baseline_bytes = current_bytes(device)
            reset_peak_bytes(device)  # this generation's peak, not an earlier engine's (CUDA; RSS cannot)
            self.restores.check(ticket)  # not an engine on the groups of a generation this rank has left
            engine = build_engine(self.spec, self.rank, self.world_size, dp, mesh=self.mesh)
            built = time.perf_counter()
            try:
                self._load(engine, step, faults, source, check=lambda: self.restores.check(ticket))
                # Published only by the latest restore, once loaded (not after a `leave` made it stale).
                self.restores.publish(ticket, lambda: setattr(self, "engine", engine))
            except BaseException as err:
                # Dropped before the turn passes: the next restore's collection must find this engine
                # unreferenced, as the frozen survivors of a collection are never freed (rank.reclaim).
                with contextlib.suppress(Exception):  # the restore's own error is the one to report
                    engine.data.close(wait=False)
                engine = None
                traceback.clear_frames(err.__traceback__)  # the loading frames' references to it
                raise
            # No reference left here when the turn passes: the next holder's collection may freeze it.
            next_step, engine = engine.next_step, None
        done = time.perf_counter()
        out = {"seconds": done - started, "build_s": built - started, "load_s": done - built,
               "rank": self.rank, "next_step": next_step,
               "storage_read_bytes": durable_bytes_read() - read_before}
        if self.rank == 0:
            out["peak_flops"] = peak_flops_per_rank(self.spec, device)
        return out

    def _load(self, engine, step: int | None, faults: list[ArmedFault] | None, source, check) -> None:
        """Fill a new engine for `restore`: from the memory snapshot `source`, from checkpoint `step`,
        from `model.from_hf`, or not at all (a fresh start). `check()` runs as each piece is read:
        it raises when this restore has gone stale (orchestrator.rank.restore_turns)."""
        from chaos.injector import FaultInjector
        from monitor.progress import Progress
        from orchestrator.rank.state import load_engine_state, load_from_memory, load_pretrained, restore_storage_setup

        def checked(advance=lambda n, total: None):
            return lambda n, total: (check(), advance(n, total))

        hook = FaultInjector.hook_for(faults or [], self.rank, self.store.send)  # its during_restore point
        if source is not None:
            load_from_memory(engine, source, self.held, on_bytes=checked(), check=check, fault_hook=hook)
        elif step is not None:
            # Rank 0 says how far a long restore is, a line every 10 s in the driver's log.
            with Progress(f"rank 0: restoring step {step}", enabled=self.rank == 0) as progress:
                load_engine_state(self.spec, engine, step, fault_hook=hook, on_bytes=checked(progress.advance),
                                  storage_setup=restore_storage_setup(self.spec, faults, self.rank, self.store.send),
                                  interrupt=check)
        elif self.spec.model.from_hf:
            load_pretrained(self.spec, engine, on_bytes=checked(), interrupt=check)

    def train(self, until_step: int, faults: list[ArmedFault], buddy=None, eval_at=None) -> dict:
        """`buddy`: the actor that keeps a copy of this rank's memory snapshots (None: the level is off,
        or the job has one rank); `eval_at`: a validation owed at the restored step (RankLoop.run)."""
        from orchestrator.rank.loop import RankLoop
        from orchestrator.rank.snapshots import MemorySnapshots

        snapshots = None
        if self.spec.checkpoint.memory.enabled:
            store = self.snapshot_store
            snapshots = lambda tag: MemorySnapshots(self.held, self.rank, self.gen, tag, buddy, store.send)  # noqa: E731
        loop = RankLoop(self.spec, self.engine, self.store, self.rank, self.world_size, self._abort,
                        baseline_bytes=self.baseline_bytes, writer_store=self.writer_store, snapshots=snapshots,
                        release_peers=self.sockets.abort)
        # One event per generation: a watcher still in a store round trip when its generation ends
        # must not find the event cleared again by the next `train` and poll on into it.
        training_over = threading.Event()
        watched = (self.watch_store, training_over, self._abort, self.sockets)  # this generation's own
        watcher = threading.Thread(target=watch_abort, args=watched, daemon=True, name="abort-watcher")
        watcher.start()
        try:
            out = loop.run(until_step, faults, eval_at)
        except BaseException as err:  # a collective error or an injected exception
            # Release the peers first (they may be blocked in a collective with us), then clean up.
            self.sockets.abort()
            self._teardown()
            log.exception("rank %d: training stopped at step %d", self.rank, self.engine.next_step)
            out = {"status": "aborted", "rank": self.rank, "step": self.engine.next_step, "error": error_line(err)}
        finally:
            training_over.set()
            with self._dropping:  # a writer left to finish after an abort holds its staging: no freeze meanwhile
                self._dropped += [weakref.ref(w) for w in getattr(loop, "writers", ())]
        # The next generation builds an engine of its own: reclaim this one on a thread of its own
        # while the controller detects and places, rather than inside the re-formation; the next
        # `_drop_engine` waits for it. The loop and the error's traceback (frames that hold the
        # engine) are gone by now.
        del loop
        self._drop_engine(background=True)
        return out

    def leave(self, wait_s: float = 0.0) -> bool:
        """Drop the process group and the engine; returns whether this rank can take part in the next
        generation: its node alive, and no restore of the generation left stuck: still inside after
        `wait_s` (the controller's release gives half its limit) with no progress for STUCK_S. A stale
        restore gives up at its next piece read; a stuck one holds a thread and the restore turn that
        only the process's end frees, and every later restore here would wait out its timeout, so the
        controller replaces this rank instead (orchestrator.rank.restore_turns)."""
        self.restores.supersede()  # a restore of the generation left is stale: it stops at its next check
        self.held.fence(self.gen + 1)  # its late snapshot shards can complete nothing: refused where they land
        self._teardown()  # and one inside a collective (its engine's build) fails at once
        # Waiting for it at most `wait_s` (the release gives `leave` seconds): while a stale restore
        # holds the turn it holds an engine, so collect but freeze nothing; the next restore's
        # collection, inside the turn once the stale one gave up, freezes.
        with self.restores.quiet(wait_s) as quiet:
            self._drop_engine(freeze=quiet)
        stuck = not quiet and wait_s > 0 and self.restores.silent_s() >= STUCK_S
        if stuck:
            log.warning("rank %d: a restore of generation %d has made no progress for %.0f s: stuck in a read, this "
                        "process cannot restore again (the controller replaces it)", self.rank, self.gen,
                        self.restores.silent_s())
        return not stuck and self.node_alive()

    def _drop_engine(self, background: bool = False, freeze: bool = True) -> None:
        """Release the engine's data cursor (a prefetch thread, memory maps) with the engine itself,
        and everything the engine held (orchestrator.rank.reclaim): now, or with `background` on a
        thread that the next call waits for. Also with no engine: a rank's first call (at its
        first join) pays the one full collection at start-up, so that no recovery does."""
        reclaiming, self._reclaiming = self._reclaiming, None  # read once: a stale restore may drop too
        if reclaiming is not None:
            reclaiming.join()
        with self._dropping:
            self._dropped = [ref for ref in self._dropped if ref() is not None]
            if self.engine is not None:
                self.engine.data.close(wait=False)
                self._dropped.append(weakref.ref(self.engine))
            self.engine = None
            dropped = tuple(self._dropped)
        if background:
            self._reclaiming = threading.Thread(target=reclaim_generation, args=(True, dropped), daemon=True,
                                                name="reclaim")
            self._reclaiming.start()
        else:
            reclaim_generation(freeze, dropped)

    def _teardown(self) -> None:
        import torch.distributed as dist

        if self.sockets is not None:
            self.sockets.abort()  # closes what destroy_process_group leaves open (see comm_abort)
            self.sockets = None
        self.mesh = None  # its groups go with the default one
        if dist.is_initialized():
            # A broken group may fail to tear down cleanly; it is unusable either way.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def error_line(err: BaseException, limit: int = 1000) -> str:
    """`err` and what caused it (`raise ... from`, or an error raised while handling another), on one line
    of at most `limit` characters: what the controller prints and records of a rank's error. Whole lines,
    not the first 300 characters: NCCL's own reason comes after its first lines."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen and len(parts) < 4:
        seen.add(id(err))
        parts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    text = " ".join(" <- caused by ".join(parts).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
