"""One scenario of bench.release: W gloo rank processes, one dies, how fast the survivors get out.

One scenario = one collective, W gloo ranks on 127.0.0.1 (one intra-op thread each), a store
hosted by this process. Every rank runs the collective in a loop, like training steps; after
WARMUP iterations rank 1 pauses PAUSE_S (so the others are blocked inside the next iteration)
and SIGKILLs itself. The process-group timeout is 60 s, so no release below is the timeout.
What the survivors do when their collective raises depends on the mode:

  abort    the protocol of orchestrator/rank/comm_abort.py: `sockets.abort()` then
           `destroy_process_group()`; the closed sockets cascade the error to the other survivors.
  watcher  survivors that see an error touch nothing until every survivor is out. HOLD_S after
           the kill the "controller" (this process) sets the abort key in the store; in each
           survivor still blocked, a second thread polling that key calls `sockets.abort()`.
  destroy  baseline: `destroy_process_group()` only. Watched for --cap s after the kill.
  idle     baseline: nobody does anything. Watched for --cap s after the kill.

Measured, from time.time() stamps the processes write themselves (one machine, one clock):
  release  the kill (rank 1's stamp just before SIGKILL) -> the last survivor out of its
           collective; for `watcher`, the abort key set -> the last survivor held until then out.
  re-form  the last survivor out -> every survivor has joined a new group of W-1 ranks under a
           new store prefix and checked the sum of an all_reduce in it (abort and watcher modes).

bench/release/main.py measures every scenario; tests/dist/test_comm_release.py runs them on 4 ranks.
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from orchestrator.rank.comm_abort import CommSockets

VICTIM = 1
WARMUP = 3  # iterations every rank completes before the kill (pairs and DDP buckets are set up)
PAUSE_S = 0.3  # the victim's pause before SIGKILL, while the others wait inside the next iteration
HOLD_S = 1.0  # watcher mode: kill -> the controller sets the abort key
PG_TIMEOUT_S = 60.0
FLOATS_1MB = (1 << 20) // 4
MODES = {
    "abort": "every survivor that sees an error: sockets.abort(), destroy_process_group()",
    "watcher": "only a second thread, on the controller's abort key, aborts a survivor still blocked",
    "destroy": "baseline: every survivor that sees an error: destroy_process_group() only",
    "idle": "baseline: nobody does anything",
}
REFORM = ("abort", "watcher")  # the modes whose survivors form a new group afterwards

COLLECTIVES = {
    "all_reduce_1": "all_reduce, 1 element",
    "all_reduce_1mb": "all_reduce, 1 MB",
    "all_gather": "all_gather, 1 MB in total, equal sizes",
    "reduce_scatter": "reduce_scatter_single, 1 MB in",
    "broadcast": "broadcast from rank 0, 1 MB",
    "send_recv": "send/recv ring, 1 MB (pipeline-style)",
    "barrier": "barrier",
    "ddp": "DDP backward, 1 MB of grads in 4 buckets",
    "mesh": "dp x pp=2 DeviceMesh: 1 MB send/recv on the pp sub-group, then all_reduce on the dp sub-group",
}


def make_step(collective: str, rank: int, world_size: int):
    """One iteration of `collective` on the current default group, as a no-argument callable."""
    one_mb = torch.ones(FLOATS_1MB)
    if collective == "all_reduce_1":
        x = torch.ones(1)
        return lambda: dist.all_reduce(x)
    if collective == "all_reduce_1mb":
        return lambda: dist.all_reduce(one_mb)
    if collective == "all_gather":
        part = torch.ones(FLOATS_1MB // world_size)
        parts = [torch.empty_like(part) for _ in range(world_size)]
        return lambda: dist.all_gather(parts, part)
    if collective == "reduce_scatter":
        out = torch.empty(FLOATS_1MB // world_size)
        return lambda: dist.reduce_scatter_single(out, one_mb)
    if collective == "broadcast":
        return lambda: dist.broadcast(one_mb, src=0)
    if collective == "send_recv":
        # A token goes round the ring each iteration: rank 0 sends first, every other rank
        # receives from its predecessor, then sends to its successor (a pipeline's pattern).
        def ring():
            succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
            if rank == 0:
                dist.send(one_mb, succ)
                dist.recv(one_mb, pred)
            else:
                dist.recv(one_mb, pred)
                dist.send(one_mb, succ)
        return ring
    if collective == "barrier":
        return dist.barrier
    if collective == "ddp":
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 256, bias=False) for _ in range(4)]  # 4 x 256 KB of grads
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.25)
        batch = torch.randn(8, 256)
        return lambda: model(batch).sum().backward()
    if collective == "mesh":
        return _mesh_step(rank, world_size, one_mb)
    raise ValueError(f"unknown collective {collective!r}")


def _mesh_step(rank: int, world_size: int, one_mb):
    """A pipeline step on sub-groups (the engine's pattern at pp = 2): stage 0 sends its
    activations to stage 1 over the pp group, then both all-reduce gradients over their dp group.
    The sub-groups are process groups of their own, with sockets opened after init."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(world_size).reshape(world_size // 2, 2), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    stage, peer = rank % 2, rank ^ 1  # pp group: (2k, 2k + 1)

    def step():
        if stage == 0:
            dist.send(one_mb, peer, group=pp_group)
        else:
            dist.recv(one_mb, peer, group=pp_group)
        dist.all_reduce(one_mb, group=dp_group)
    step.mesh = mesh  # keep the groups alive
    return step


def join_group(store, prefix: str, rank: int, world_size: int) -> CommSockets:
    """init_process_group under a store prefix, capturing the sockets it opens (comm_abort's step 1)."""
    with CommSockets.capture() as sockets:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
    return sockets


def _connect(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=PG_TIMEOUT_S))


def _watch(port: int, sockets: CommSockets, out: threading.Event) -> None:
    """Watcher thread, with its own store connection: on the abort key, abort our group if still blocked."""
    store = _connect(port)
    while not out.is_set():
        if store.check(["abort"]):
            if not out.is_set():
                sockets.abort()
            return
        time.sleep(0.01)


def _rank(rank: int, world_size: int, port: int, collective: str, mode: str) -> None:
    """One rank of a scenario (module docstring). Reports through the store, then waits for `done`."""
    torch.set_num_threads(1)
    store = _connect(port)
    survivors = [r for r in range(world_size) if r != VICTIM]
    try:
        sockets = join_group(store, "gen0", rank, world_size)
        with sockets.adding():  # the sub-groups a step may create (comm_abort's step 1)
            step = make_step(collective, rank, world_size)  # keep it (and DDP's reference to the group) alive
        for _ in range(WARMUP):
            step()
        if rank == VICTIM:
            time.sleep(PAUSE_S)
            store.set("kill", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        out = threading.Event()
        if mode == "watcher":
            threading.Thread(target=_watch, args=(port, sockets, out), daemon=True).start()
        try:
            while True:
                step()
        except Exception as err:  # the broken collective
            t_out = time.time()
            out.set()
            error = re.sub(r"\[/\S+\] ", "", f"{type(err).__name__}: {err}")[:160]
            store.set(f"out/{rank}", json.dumps({"t": t_out, "error": error}))
        result = {"t_out": t_out}
        if mode == "abort":
            sockets.abort()
        elif mode == "watcher":  # touch nothing until the watchers have released every survivor
            store.wait([f"out/{r}" for r in survivors], timedelta(seconds=PG_TIMEOUT_S))
        if mode != "idle":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if mode in REFORM:
            join_group(store, "gen1", survivors.index(rank), len(survivors))
            total = torch.tensor([float(rank + 1)])
            dist.all_reduce(total)
            result["t_checked"] = time.time()
            result["sum"] = total.item()
            dist.destroy_process_group()
    except Exception:
        result = {"exception": traceback.format_exc()}
    store.set(f"result/{rank}", json.dumps(result))
    store.wait(["done"], timedelta(seconds=PG_TIMEOUT_S))
    os._exit(0)  # skip interpreter teardown: the broken group's objects need not tear down cleanly


_CONTEXT = None


def _context():
    """A forkserver with torch imported: a rank starts in milliseconds instead of seconds."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])
    return _CONTEXT


def _read(store, key: str):
    return json.loads(store.get(key)) if store.check([key]) else None


def run_scenario(collective: str, world_size: int, mode: str = "abort", cap_s: float = 3.0,
                 timeout_s: float = 60.0) -> dict:
    """Run one scenario (module docstring) and return what it measured:

    released: every survivor left its collective (within `cap_s` of the kill for `destroy` and
    `idle`, within `timeout_s` otherwise); blocked: the survivors still inside it then (for
    `watcher`: when the abort key was set); release_s: kill -> last survivor out (`watcher`: key ->
    last of the blocked ones out; None when none was blocked), None unless released; reform_s:
    last out -> the new group's all_reduce done on every survivor; sums (what each survivor's
    all_reduce gave) and expected (the right sum). Raises if a rank fails otherwise."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _context()
    procs = [ctx.Process(target=_rank, args=(r, world_size, store.port, collective, mode), daemon=True)
             for r in range(world_size)]
    survivors = [r for r in range(world_size) if r != VICTIM]
    for proc in procs:
        proc.start()
    blocked: list[int] = []
    try:
        deadline = time.time() + timeout_s
        t_kill = _wait_for_kill(store, procs, deadline, timeout_s)
        at_key, t_from = _hold_then_abort(store, survivors, t_kill) if mode == "watcher" else ([], t_kill)
        end = deadline if mode in REFORM else min(deadline, t_kill + cap_s)
        outs, results = _wait_for_survivors(store, procs, survivors, mode, end)
        blocked = [r for r in survivors if outs[r] is None]
        return _report(collective, world_size, mode, (t_kill, t_from), at_key, outs, results)
    finally:
        _stop(store, procs, blocked)


def _wait_for_kill(store, procs, deadline: float, timeout_s: float) -> float:
    """The victim's time.time() just before its SIGKILL, once it is in the store."""
    while not store.check(["kill"]):
        _check_alive(procs)
        if time.time() > deadline:
            raise TimeoutError(f"rank {VICTIM} did not reach the kill within {timeout_s:.0f} s")
        time.sleep(0.01)
    return float(store.get("kill"))


def _hold_then_abort(store, survivors: list[int], t_kill: float) -> tuple[list[int], float]:
    """`watcher`: HOLD_S after the kill, set the abort key; the survivors still blocked then, and when."""
    time.sleep(max(0.0, t_kill + HOLD_S - time.time()))
    at_key = [r for r in survivors if not store.check([f"out/{r}"])]
    t_from = time.time()
    store.set("abort", repr(t_from))
    return at_key, t_from


def _wait_for_survivors(store, procs, survivors: list[int], mode: str, end: float) -> tuple[dict, dict]:
    """Until `end`, wait for every survivor to be out (or, in the re-forming modes, done re-forming);
    then each survivor's `out` and `result` record (None where missing). Raises if a rank failed."""
    keys = [f"result/{r}" if mode in REFORM else f"out/{r}" for r in survivors]
    while not store.check(keys) and time.time() < end:
        _check_alive([procs[r] for r in survivors])
        time.sleep(0.01)
    outs = {r: _read(store, f"out/{r}") for r in survivors}
    results = {r: _read(store, f"result/{r}") for r in survivors}
    for r, res in results.items():
        if res and "exception" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['exception']}")
    return outs, results


def _report(collective: str, world_size: int, mode: str, times: tuple[float, float], at_key: list[int],
            outs: dict, results: dict) -> dict:
    """run_scenario's record, from the survivors' records; `times` = (the kill, the abort key or the kill)."""
    t_kill, t_from = times
    survivors = list(outs)
    blocked = [r for r in survivors if outs[r] is None]
    out_times = {r: o["t"] for r, o in outs.items() if o}
    if mode == "watcher":
        released_late = [out_times[r] for r in at_key if r in out_times]
        release_s = max(released_late) - t_from if at_key and not blocked else None
    else:
        release_s = None if blocked else max(out_times.values()) - t_kill
    report = {
        "collective": collective, "world_size": world_size, "mode": mode, "released": not blocked,
        "release_s": release_s, "first_out_s": min(out_times.values(), default=t_kill) - t_kill,
        "blocked": at_key if mode == "watcher" else blocked,
        "errors": {r: o["error"] for r, o in outs.items() if o},
    }
    if mode in REFORM and all(results.values()):
        report["reform_s"] = max(res["t_checked"] for res in results.values()) - max(out_times.values())
        report["sums"] = [results[r]["sum"] for r in survivors]
        report["expected"] = float(sum(r + 1 for r in survivors))
    return report


def _stop(store, procs, blocked: list[int]) -> None:
    """Release the ranks waiting for `done`; kill the survivors still blocked (`destroy`, `idle`: they would
    never exit) and any rank not gone 5 s later."""
    store.set("done", "1")
    for r in blocked:
        procs[r].kill()
    join_until = time.time() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.1, join_until - time.time()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _check_alive(procs) -> None:
    dead = [p.pid for p in procs if p.exitcode is not None]
    if dead:
        raise RuntimeError(f"rank process(es) {dead} exited early")
