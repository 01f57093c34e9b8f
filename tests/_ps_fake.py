"""An in-process fake of Ray for the parameter-server supervisor's tests (tests/unit/test_ps_supervisor.py).

It keeps the protocol's real arithmetic (ShardServer and PSWorker of a tiny model) and Ray's
shape as the supervisor sees it: actor handles whose `.remote` calls answer at once, workers' runs
as streams of step logs, `ray.kill`, and a clock that moves one poll per `ray.wait` with a timeout
(each live worker does at most one step per poll, in bsp the others wait for the slowest).
"""

from __future__ import annotations

import copy
import functools
import types
from collections import Counter, deque

import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from monitor.goodput import GoodputLedger
from paramserver import supervisor as sup
from paramserver.actors import Progress, ServerStats, StepLog
from paramserver.lockstep import build_in_process, run_lockstep
from paramserver.shard import ShardServer
from paramserver.update_history import RecordOutbox
from paramserver.worker import PSWorker
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

MODEL = ModelConfig(preset="tiny", n_layers=1, d_model=16, d_ff=32, n_heads=2, vocab_size=32, max_seq_len=16)
DATA = DataConfig(seq_len=8)
TRAIN = TrainConfig(steps=8, global_batch=4, micro_batch=1, grad_clip=None, lr=3e-3)
PAR = ParallelConfig(dp=2, mode="ps", servers=2)
PIECES = 400


class Died(RayActorError):
    def __init__(self, what: str = "actor died"):
        Exception.__init__(self, what)

    def __str__(self) -> str:
        return self.args[0]


class CallFailed(RayTaskError):
    def __init__(self, what: str = "a call of the run failed"):
        Exception.__init__(self, what)

    def __str__(self) -> str:
        return self.args[0]


class Ref:
    def __init__(self, value=None, error=None, ready=None):
        self.value, self.error, self._ready = value, error, ready

    def ready(self) -> bool:
        return True if self._ready is None else self._ready()


class Stream:
    def __init__(self):
        self.items: deque[StepLog] = deque()
        self.error: BaseException | None = None
        self.ended = self.delivered = False

    def completed(self) -> Ref:
        return Ref(ready=lambda: self.ended)

    def ready(self) -> bool:
        return bool(self.items) or self.ended

    def end(self, error: BaseException | None = None) -> None:
        if not self.ended:
            self.ended, self.error = True, error

    def __next__(self) -> Ref:
        if self.items:
            return Ref(self.items.popleft())
        assert self.ended, "the supervisor would block on a running stream"
        if self.error is not None and not self.delivered:
            self.delivered = True
            return Ref(error=self.error)
        raise StopIteration


class Method:
    def __init__(self, actor, fn):
        self.actor, self.fn = actor, fn

    def remote(self, *args, **kwargs) -> Ref:
        if self.actor.dead:
            return Ref(error=Died())
        if self.actor.sigstopped:  # answered once it is killed (then as a dead actor's call)
            return Ref(error=Died(), ready=lambda: self.actor.dead)
        try:
            return Ref(self.fn(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 (delivered through the ref, as Ray does)
            return Ref(error=err)


class FakeServer:
    def __init__(self, world, k: int):
        setup = world.setup
        self.shard = ShardServer(k, setup.servers[k].slices, MODEL, TRAIN, PAR.dp, PAR.consistency)
        self.pid, self.dead, self.stopped, self.sigstopped = world.new_pid(), False, False, False
        self.holds: set[tuple[int, int]] = set()
        self.waiting: set[tuple[int, int]] = set()
        self.frozen, self.cut_at, self.answered, self.outbox = False, None, -1, RecordOutbox()
        self.where = world.place("server", k)
        for name in ("progress", "stats", "hold", "held", "drop_held", "abort", "reopen", "freeze", "cut", "uncut",
                     "node", "hang"):
            setattr(self, name, Method(self, getattr(self, "_" + name)))

    def _freeze(self):
        self.frozen = True
        return self.answered

    def _cut(self, step):
        self.cut_at, self.frozen = step, False
        self.holds = {h for h in self.holds if h[1] < step}
        self.waiting = {h for h in self.waiting if h[1] < step}

    def _uncut(self):
        self.cut_at = None

    def _node(self):
        return self.where

    def _hang(self):
        self.sigstopped = True

    def _progress(self):
        return Progress(self.shard.index, self.pid, self.shard.version, list(self.shard.clocks.pushed))

    def _stats(self, acked=0):
        s, (new, self.shard.records) = self.shard, (self.shard.records, [])
        return ServerStats(s.index, s.version, s.bytes_in, s.bytes_out, self.outbox.take(acked, new), self.outbox.batch)

    def _hold(self, worker, step):
        if self.cut_at is None or step < self.cut_at:
            self.holds.add((worker, step))

    def _held(self):
        return sorted(self.waiting)

    def _drop_held(self, worker):
        self.holds = {h for h in self.holds if h[0] != worker}
        self.waiting = {h for h in self.waiting if h[0] != worker}

    def _abort(self):
        self.stopped, self.holds, self.waiting = True, set(), set()

    def _reopen(self, step):
        self.shard.records = [r for r in self.shard.records if r.step < step]
        self.outbox.drop_from(step)
        self.shard.pending.clear()
        self.stopped = False

    def kill(self):
        self.dead = True


class FakeWorker:
    def __init__(self, world, w: int):
        self.dead, self.sigstopped, self.proc = False, False, world.new_pid()
        self.ready_at = 0.0  # its first step waits for the clock to reach this (a slow start-up)
        self.worker = PSWorker(w, PAR.dp, MODEL, DATA, TRAIN, [s.slices for s in world.setup.servers])
        self.stream: Stream | None = None
        self.next = self.end = 0  # the run's steps, once it is called
        self.pid = Method(self, lambda: self.proc)
        self.node = Method(self, lambda where=world.place("worker", w): where)
        self.hang = Method(self, lambda: setattr(self, "sigstopped", True))
        self.run = types.SimpleNamespace(remote=self._run)  # a generator's call gives its stream itself

    def _run(self, servers, start, end, slow_s=0.0):
        self.servers, self.next, self.end, self.stream = list(servers), start, end, Stream()
        return self.stream

    def kill(self):
        self.dead = True
        if self.stream is not None:
            self.stream.end(Died("worker actor died"))

    def advance(self, now: float) -> None:
        stream, step, w = self.stream, self.next, self.worker.index
        if self.dead or self.sigstopped or stream is None or stream.ended or now < self.ready_at:
            return
        if step >= self.end:
            return stream.end()
        if any(s.dead or s.stopped for s in self.servers):
            return stream.end(CallFailed())
        if any(s.sigstopped for s in self.servers):
            return  # its calls wait
        if any(s.cut_at is not None and step >= s.cut_at for s in self.servers):
            return stream.end()  # SegmentCut: the run ends cleanly
        if any(s.frozen for s in self.servers):
            return
        for server in self.servers:
            if (w, step) in server.holds:
                server.waiting.add((w, step))
                return
            if not server.shard.may_read(step):
                return
        rows = self.worker.rows_needed(step)
        pulled = [s.shard.pull(w, step, rows) for s in self.servers]
        for server in self.servers:
            server.answered = max(server.answered, step)
        for answer in pulled:
            self.worker.load(answer)
        loss, tokens = self.worker.compute(step)
        for server, push in zip(self.servers, self.worker.pushes(step, pulled, tokens), strict=True):
            server.shard.push(push)
        stream.items.append(StepLog(w, step, loss, tokens, 0.0, 0.0, 0.0, now, self.proc))
        self.next += 1


class World:
    """The fake cluster: actors, the clock, the committed checkpoints."""

    def __init__(self):
        self.setup = build_in_process(MODEL, DATA, TRAIN, PAR, PIECES)
        self.now, self.pids, self.workers = 1000.0, 0, []
        self.commits: dict[int, list[ShardServer]] = {}
        self.states: dict[int, dict | None] = {}  # step -> the state its save carried
        self.nodes: dict[tuple[str, int], str] = {}  # (kind, index) -> the node of its first actor
        self.placed: set[tuple[str, int]] = set()

    def place(self, kind: str, index: int) -> str:
        """The node a new actor runs on: as `nodes` says for the first, elsewhere for a replacement."""
        first = (kind, index) not in self.placed
        self.placed.add((kind, index))
        return self.nodes.get((kind, index), "safe") if first else "elsewhere"

    def new_pid(self) -> int:
        self.pids += 1
        return 100 + self.pids

    def start_worker(self, w: int) -> FakeWorker:
        worker = FakeWorker(self, w)
        self.workers.append(worker)
        return worker

    def tick(self) -> None:
        self.now += sup.POLL_S
        for worker in self.workers:
            worker.advance(self.now)

    # ---- ray ----

    def get(self, refs, timeout=None):
        if isinstance(refs, list):
            if not all(r.ready() for r in refs):
                self.now += timeout or 0.0  # Ray waits out the timeout (none here: it would wait for ever)
                raise GetTimeoutError("a call is not answered")
            return [self.get(r) for r in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def wait(self, items, num_returns=1, timeout=None, fetch_local=True):
        if timeout:
            self.tick()
        ready = [i for i in items if i.ready()]
        return ready, [i for i in items if not i.ready()]

    def kill(self, actor, no_restart=True):
        actor.kill()

    # ---- paramserver.checkpoint ----

    def save(self, servers, root, step, *, job, storage_options=None, owner=None, state=None, timeout=None,
             skipped=frozenset(), unsure=None):
        if step in skipped:  # as paramserver.checkpoint refuses it
            raise sup.checkpoint.PSCheckpointError(f"step {step} is committed by an earlier run")
        for s in servers:
            assert s.shard.clocks.pushed == [step] * PAR.dp, "a save off the cut"
        self.commits[step] = [copy.deepcopy(s.shard) for s in servers]
        self.states[step] = state  # what the manifest would carry beyond the shards (the goodput)
        return types.SimpleNamespace(step=step)  # what the supervisor reads of a ckpt.commit.Commit

    def latest(self, root, storage_options=None, owner=None, read_retry_s=None):
        return max(self.commits, default=None)

    def restore(self, servers, root, step, *, storage_options=None, clock=None, read_retry_s=None, timeout=None):
        for server in servers:
            server.shard = copy.deepcopy(self.commits[step][server.shard.index])


# ---- what the supervisor's tests share (tests/unit/test_ps_supervisor*.py) ----


def fake_ray(monkeypatch) -> World:
    """A World, with the supervisor's modules' Ray, clock and checkpoint calls pointed at it."""
    torch.set_num_threads(1)
    fake = World()
    ray = types.SimpleNamespace(get=fake.get, wait=fake.wait, kill=fake.kill)
    for module in ("paramserver.supervisor", "paramserver.streams", "paramserver.moves",
                   "paramserver.update_history", "paramserver.watchdog", "paramserver.restores"):
        monkeypatch.setattr(f"{module}.ray", ray)
    monkeypatch.setattr(sup, "time", types.SimpleNamespace(time=lambda: fake.now))
    monkeypatch.setattr("paramserver.restores.time", sup.time)
    monkeypatch.setattr(sup.checkpoint, "save_ps_checkpoint", fake.save)
    monkeypatch.setattr(sup.checkpoint, "latest_committed_step", fake.latest)
    monkeypatch.setattr(sup.checkpoint, "quarantined_steps", lambda *args, **kwargs: [])  # the fake quarantines none
    monkeypatch.setattr(sup.checkpoint, "restore_servers", fake.restore)
    return fake


@functools.cache
def reference_losses() -> list[float]:
    """The failure-free run's losses, computed in one process."""
    torch.set_num_threads(1)  # as every fake actor computes (the actors set it too)
    losses, _ = run_lockstep(build_in_process(MODEL, DATA, TRAIN, PAR, PIECES), TRAIN.steps)
    return losses


def run_supervisor(world: World, faults=(), every: int | None = 4, on_commit=None, draining=None,
                   start_server=None, on_stats=None, hang=None, budget=None, on_failure=None, on_step=None):
    """A Supervisor over `world` run to the end: (supervisor, losses, goodput ledger)."""
    actors = sup.Actors(start_server or (lambda k: FakeServer(world, k)), world.start_worker)
    checkpoints = sup.Checkpoints("fake://ckpt", every, job=None, on_commit=on_commit,
                                  draining=draining) if every else None
    ledger = GoodputLedger(clock=lambda: world.now)
    supervisor = sup.Supervisor(actors, PAR.servers, PAR.dp, TRAIN.steps, checkpoints=checkpoints,
                                faults=list(faults), ledger=ledger, on_stats=on_stats, hang=hang, budget=budget,
                                on_failure=on_failure, on_step=on_step)
    supervisor.run()
    ledger.stop()
    return supervisor, supervisor.logs.losses(), ledger


def applied_once(supervisor) -> bool:
    """Every (server, worker, step) applied exactly once in the records the driver took."""
    applied = Counter((r.server, r.worker, r.step) for r in supervisor.history.kept)
    return applied == Counter({(k, w, s): 1 for k in range(PAR.servers) for w in range(PAR.dp)
                               for s in range(TRAIN.steps)})
