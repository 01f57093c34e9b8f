"""Release from a broken collective: how fast every survivor leaves its collective when a rank dies.

    .venv/bin/python bench/release.py [--world-sizes 4 8] [--repeats 3] [--cap 3] [--modes ...]

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

Prints a table (median and max over --repeats), writes runs/bench/release.json and replaces its
own section of docs/benchmarks.md. tests/dist/test_comm_release.py runs the same scenarios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._docs import median_max, ms, replace_section  # noqa: E402  (needs the repository on sys.path)
from orchestrator.rank.comm_abort import CommSockets  # noqa: E402

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
    raise ValueError(f"unknown collective {collective!r}")


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
        while not store.check(["kill"]):
            _check_alive(procs)
            if time.time() > deadline:
                raise TimeoutError(f"rank {VICTIM} did not reach the kill within {timeout_s:.0f} s")
            time.sleep(0.01)
        t_kill = t_from = float(store.get("kill"))
        if mode == "watcher":
            time.sleep(max(0.0, t_kill + HOLD_S - time.time()))
            at_key = [r for r in survivors if not store.check([f"out/{r}"])]
            t_from = time.time()
            store.set("abort", repr(t_from))
        keys = [f"result/{r}" if mode in REFORM else f"out/{r}" for r in survivors]
        end = deadline if mode in REFORM else min(deadline, t_kill + cap_s)
        while not store.check(keys) and time.time() < end:
            _check_alive([procs[r] for r in survivors])
            time.sleep(0.01)
        outs = {r: _read(store, f"out/{r}") for r in survivors}
        results = {r: _read(store, f"result/{r}") for r in survivors}
        for r, res in results.items():
            if res and "exception" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['exception']}")
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
    finally:
        store.set("done", "1")
        for r in blocked:  # `destroy` and `idle`: still inside the collective, they would never exit
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


# ---------------------------------------------------------------------------------------------
# Bench: table, JSON and docs section.

SECTION = "## Release from a broken collective"
NOTES = ("<!-- release-notes: kept when bench/release.py rewrites this section -->", "<!-- /release-notes -->")


def _cells(runs: list[dict], mode: str, cap_s: float) -> str:
    """One mode's cell of one table row."""
    runs = [r for r in runs if r["mode"] == mode]
    if not runs:
        return "-"
    stuck = [r for r in runs if not r["released"]]
    ranks = sorted({b for r in stuck for b in r["blocked"]})
    if mode in ("destroy", "idle"):
        if stuck:
            return f"> {cap_s:g} s: rank(s) {','.join(map(str, ranks))} still blocked in {len(stuck)}/{len(runs)} runs"
        return f"all out, max {ms(max(r['release_s'] for r in runs))}"
    if stuck:
        return f"NOT released in {len(stuck)}/{len(runs)} runs (rank(s) {','.join(map(str, ranks))})"
    if mode == "watcher":
        held = [r for r in runs if r["blocked"]]
        if not held:
            return "n/a: every survivor errored by itself"
        at_key = sorted({b for r in held for b in r["blocked"]})
        return f"{median_max([r['release_s'] for r in held])}, rank(s) {','.join(map(str, at_key))} held"
    return median_max([r["release_s"] for r in runs])


def table(runs: list[dict], cap_s: float) -> str:
    lines = ["| collective | ranks | release with abort | re-form | watcher: key -> out | destroy only | no action |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["collective"], r["world_size"]) for r in runs},
                  key=lambda k: (list(COLLECTIVES).index(k[0]), k[1]))
    for collective, world_size in keys:
        of = [r for r in runs if (r["collective"], r["world_size"]) == (collective, world_size)]
        reformed = [r for r in of if r["mode"] == "abort" and "reform_s" in r]
        wrong = [r for r in reformed if set(r["sums"]) != {r["expected"]}]
        reform = median_max([r["reform_s"] for r in reformed]) + (f" WRONG SUM in {len(wrong)} runs" if wrong else "")
        cells = [COLLECTIVES[collective], str(world_size), _cells(of, "abort", cap_s), reform,
                 *(_cells(of, mode, cap_s) for mode in ("watcher", "destroy", "idle"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section(runs: list[dict], args, command: str) -> str:
    return f"""{SECTION}

Measured by `bench/release.py` on {time.strftime("%Y-%m-%d")}. Command:

```bash
{command}
```

Machine: {os.cpu_count()} cores, no GPU; Python {platform.python_version()}, torch {torch.__version__}, gloo on
127.0.0.1, one intra-op thread per rank, ranks forked from a forkserver; 1-minute load average
{os.getloadavg()[0]:.1f} when the run ended (the machine is shared).

Each rank runs the collective in a loop; after {WARMUP} iterations rank 1 pauses {PAUSE_S} s (the others are
then inside the next iteration) and SIGKILLs itself. Process-group timeout {PG_TIMEOUT_S:.0f} s. Cells are
median (max) over {args.repeats} run(s); timestamps are `time.time()` written by the processes themselves.
- release with abort: kill -> last survivor out of its collective, when every survivor that sees an error
  calls `CommSockets.abort()` then `destroy_process_group()` (orchestrator/rank/comm_abort.py).
- re-form: last survivor out -> every survivor has joined a new group of W-1 ranks (new store prefix) and
  checked an all_reduce sum in it (abort runs; watcher runs' re-form times are in the JSON).
- watcher: survivors that see an error touch nothing; {HOLD_S:g} s after the kill the controller sets the abort
  key and, in each survivor still blocked ("held"), a second thread calls `sockets.abort()`; key -> last out.
- destroy only / no action: survivors that see an error call `destroy_process_group()` only / do nothing;
  watched for {args.cap:g} s after the kill.

{table(runs, args.cap)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap", type=float, default=3.0, help="seconds the baselines are watched for")
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=list(COLLECTIVES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", default="runs/bench/release.json")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python bench/release.py", *map(shlex.quote, sys.argv[1:])])

    runs = []
    for collective in args.collectives:
        for world_size in args.world_sizes:
            for mode in args.modes:
                for _ in range(args.repeats):
                    run = run_scenario(collective, world_size, mode, cap_s=args.cap)
                    runs.append(run)
                    release = "-" if run["release_s"] is None else ms(run["release_s"])
                    reform = ms(run["reform_s"]) if "reform_s" in run else "-"
                    print(f"{collective:15s} W={world_size} {mode:8s} released={run['released']!s:5s}"
                          f" release {release:>7s} blocked {run['blocked']} re-form {reform}", flush=True)
    print(table(runs, args.cap))
    out = ROOT / args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "cap_s": args.cap, "modes": MODES, "runs": runs}, indent=1))
    print(f"wrote {out}")
    if args.docs:
        replace_section(ROOT / args.docs, SECTION, section(runs, args, command), NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")


if __name__ == "__main__":
    main()
