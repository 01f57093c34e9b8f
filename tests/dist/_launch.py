"""Run a function on N local processes joined in a gloo process group, and collect the results.

    results = run_ranks(fn, world_size=4, args=(...,))

`fn(rank, world_size, *args)` runs in a fresh process with one intra-op thread (so eight
ranks fit on two cores) after `init_process_group("gloo")` on 127.0.0.1 and a free port; its
return value is pickled back through a file. Each rank is forked from a server process that
imported torch and the engine once for the whole session (`PRELOAD`): a spawned rank spent
about 4 s of a core importing them, as much as many tests' training. `fn` must be importable
(defined at module level). A failing rank fails the call with its traceback; a hang fails it
at the timeout, after the ranks are killed.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports once; a rank forked from it starts with these in memory. It
# imports nothing that starts a thread (a fork copies no thread but the caller).
PRELOAD = ["torch", "torch.distributed", "trainer.engine", "ckpt.writer", "ckpt.reader"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _entry(rank: int, payload: bytes, world_size: int, port: int, out_dir: str) -> None:
    fn, args = pickle.loads(payload)
    # A rank that dies in native code (SIGSEGV, SIGABRT) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    init_gloo(rank, world_size, port)
    try:
        result = fn(rank, world_size, *args)
        # Free engines (DDP sits in reference cycles) while their process group is alive, and
        # let every rank finish its last collective before rank 0 closes the store.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as handle:
        pickle.dump(result, handle)


# Signals of a rank that died in native code: torch 2.13's gloo functional collectives (under DTensor
# tensor parallelism: `wait_tensor` of loss_parallel, `reduce_scatter_single` of a redistribute)
# crash rarely and not reproducibly on CPU, by SIGSEGV or by glibc's heap check ("malloc(): unaligned
# tcache chunk detected", SIGABRT), in code this project does not own.
NATIVE_CRASHES = ("SIGSEGV", "SIGABRT", "SIGBUS")
CRASH_RERUNS = 2


def run_ranks(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0) -> list:
    """[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)], each in its own process.

    A rank that dies by a native crash (NATIVE_CRASHES) runs the whole call again, at most
    CRASH_RERUNS times, each with a warning that carries the crash; a crash every time fails the
    call, and so does any other failure at once."""
    for attempt in range(CRASH_RERUNS + 1):
        try:
            return _run_ranks_once(fn, world_size, args, timeout_s)
        except mp.ProcessExitedException as err:
            if err.signal_name not in NATIVE_CRASHES or attempt == CRASH_RERUNS:
                raise
            warnings.warn(f"a rank died by {err.signal_name} in native code ({err}); running the {world_size} "
                          "ranks again", stacklevel=2)
    raise AssertionError("unreachable")


def _run_ranks_once(fn: Callable, world_size: int, args: tuple, timeout_s: float) -> list:
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first call
    with tempfile.TemporaryDirectory() as out_dir:
        # Pickled here, by value: torch's own pickler would hand each tensor in `args` over as a
        # shared-memory file descriptor, and a fork server takes at most 256 per process.
        payload = pickle.dumps((fn, args))
        context = mp.start_processes(
            _entry, args=(payload, world_size, free_port(), out_dir), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s:.0f} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as handle:
                results.append(pickle.load(handle))
        return results
