"""The process-group check: one process per GPU, the engine's collectives, every rank's values.

Which collectives: the ones the engine issues, by who issues them:
  all_reduce SUM        token counts, loss sums and gradient norms (trainer/loss.py, grad_clip.py,
                        pipeline.py, engine.py) and DDP's gradient buckets
  all_reduce MAX        the fp16 loss scaler's found-inf flag (trainer/scaler.py)
  all_gather_into_tensor, reduce_scatter_tensor
                        FSDP2 (ZeRO-2/3): parameters gathered, gradients reduce-scattered
  broadcast             DDP's initial parameter sync, ZeroRedundancyOptimizer's (ZeRO-1) partitions
  batch_isend_irecv     pipeline activations and gradients (trainer/pipeline.py, pipedream.py)
  barrier               the pipeline's step window

Protocol: `run_collectives(world, backend)` (the main process) starts `world` processes with
the spawn method (`world` = the visible GPUs for NCCL); each initialises the process group on
its own device, runs every op for each dtype and size, compares its own output with the value
computed independently on the host (`expected`), writes its verdicts to a file, and tears the
group down; the main process merges the files per op, naming the ranks that were wrong.
Rank r contributes x_r[i] = (r + 1) * (i % 3 + 1): small integers, exact in fp32, and in bf16
while the largest sum, 3 W (W + 1) / 2, stays within bf16's exact integers (256): up to W = 12.

At a world of W > 1 the ranks then train the engine itself over the group, DDP and ZeRO-3,
against a one-process reference (bench.gpu_check.engine_parity). At a world of one every
output equals its input whatever the collective does, so the check then proves only that
NCCL initialises, launches on the device and tears down; its rows say so, and neither the
point-to-point ring (a rank sending to itself) nor the engine's layouts are run.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.gpu_check import engine_parity
from bench.gpu_check.verdict import FAIL, NOT_TESTED, OK, Row

OPS = ("all_reduce_sum", "all_reduce_max", "all_gather", "reduce_scatter", "broadcast", "send_recv")
SIZES = (1021, 1 << 21)  # an odd few KiB (NCCL's low-latency protocol) and 8 MiB of fp32 (its bulk path)
GROUP_TIMEOUT = timedelta(seconds=60)
# The ranks' start-up (imports), their collectives and engine runs, their exit: a NCCL that hangs costs
# this much of a scarce device's time (the check runs last, so no other figure waits behind it).
LAUNCH_LIMIT_S = 120.0


def dtypes_for(world: int) -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16) if 3 * world * (world + 1) // 2 <= 256 else (torch.float32,)


def ops_for(world: int) -> tuple[str, ...]:
    """What a world of `world` runs: every raw op, then the engine's layouts (bench.gpu_check.
    engine_parity); a world of one runs neither the ring nor the engine (nothing to compare)."""
    if world == 1:
        return tuple(op for op in OPS if op != "send_recv")
    return OPS + tuple(engine_parity.LAYOUTS)


def contribution(rank: int, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank `rank`'s input: (rank + 1) * (i % 3 + 1), on the host."""
    return ((torch.arange(length) % 3 + 1) * (rank + 1)).to(dtype)


def expected(op: str, rank: int, world: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What rank `rank` must hold after `op` over `world` ranks with chunks of `n` elements,
    computed on the host from every rank's contribution (no collective involved)."""
    if op == "all_reduce_sum":
        return sum((contribution(r, n) for r in range(world)), torch.zeros(n)).to(dtype)
    if op == "all_reduce_max":
        return contribution(world - 1, n, dtype)
    if op == "all_gather":
        return torch.cat([contribution(r, n, dtype) for r in range(world)])
    if op == "reduce_scatter":
        total = sum((contribution(r, world * n) for r in range(world)), torch.zeros(world * n))
        return total[rank * n:(rank + 1) * n].to(dtype)
    if op == "broadcast":
        return contribution(world - 1, n, dtype)
    if op == "send_recv":
        return contribution((rank - 1) % world, n, dtype)
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def run_op(op: str, rank: int, world: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Issue `op` on the default process group; returns this rank's output (on `device`)."""
    if op == "reduce_scatter":
        out = torch.empty(n, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, contribution(rank, world * n, dtype).to(device))
        return out
    x = contribution(rank, n, dtype).to(device)
    if op == "all_reduce_sum":
        dist.all_reduce(x)
    elif op == "all_reduce_max":
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    elif op == "broadcast":
        dist.broadcast(x, src=world - 1)
    elif op == "all_gather":
        out = torch.empty(world * n, dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, x)
        return out
    elif op == "send_recv":
        received = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                        dist.P2POp(dist.irecv, received, (rank - 1) % world)])
        for work in works:
            work.wait()
        return received
    else:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    return x


def raw_problems(rank: int, world: int, device: torch.device) -> dict[str, str | None]:
    """Every raw op of `ops_for(world)`, dtype and size on the initialised default group
    (collective): {op: None, or the first wrong output seen}."""
    problems: dict[str, str | None] = {}
    for op in (op for op in ops_for(world) if op in OPS):
        problems[op] = None
        for dtype in dtypes_for(world):
            for n in SIZES:
                got = run_op(op, rank, world, n, dtype, device).cpu()
                want = expected(op, rank, world, n, dtype)
                if problems[op] is None and not torch.equal(got, want):
                    wrong = int((got != want).sum())
                    problems[op] = f"{dtype} n={n}: {wrong} of {want.numel()} elements wrong"
    return problems


def worker(rank: int, world: int, backend: str, init_method: str, out_dir: str) -> None:
    """One rank (the spawn target; also callable in-process for a world of one): the engine's
    one-process reference (world > 1, before the group exists), the raw ops, the engine's
    layouts, then `<out_dir>/rank<r>.json` with {check: problem or None} and any error."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    problems: dict[str, str | None] = {}
    error = None
    ref = engine_parity.reference(world, device) if world > 1 else None
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT, device_id=device if device.type == "cuda" else None)
    try:
        problems.update(raw_problems(rank, world, device))
        for name in engine_parity.LAYOUTS if ref is not None else ():
            problems[name] = engine_parity.layout_problem(name, rank, world, device, ref)
        dist.barrier()
    except Exception:  # recorded for the table; the other ranks' group timeout ends their wait
        error = traceback.format_exc(limit=3)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "error": error}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_collectives(world: int, backend: str = "nccl") -> dict:
    """Spawn `world` ranks of `worker` and merge their verdicts (see `merge`)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        launch_error = None
        try:
            context = torch.multiprocessing.start_processes(worker, args=(world, backend, init_method, tmp),
                                                            nprocs=world, join=False, start_method="spawn")
            deadline = time.monotonic() + LAUNCH_LIMIT_S  # an NCCL init or teardown that hangs must not take
            while not context.join(timeout=1.0):  # the whole GPU run with it (the collectives have their own)
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    raise TimeoutError(f"the ranks did not end within {LAUNCH_LIMIT_S:g} s")
        except Exception as exc:  # a rank that died or hung: merge() reports its missing verdicts
            launch_error = f"{type(exc).__name__}: {exc}"
        reports = {}
        for rank in range(world):
            path = Path(tmp, f"rank{rank}.json")
            reports[rank] = json.loads(path.read_text()) if path.exists() else None
    return merge(reports, world, backend, launch_error)


def merge(reports: dict[int, dict | None], world: int, backend: str, launch_error: str | None = None) -> dict:
    """Per op: ok only if every rank ran it and held the expected value; `bad` names the ranks
    (with the first problem seen) that did not. A rank without a report counts against every op."""
    ops = {}
    for op in ops_for(world):
        bad = {}
        for rank in range(world):
            report = reports.get(rank)
            if report is None:
                bad[rank] = "no report (the process died)"
            elif report["problems"].get(op, "not run") is not None:
                bad[rank] = report["problems"].get(op) or report.get("error") or "not run"
        ops[op] = {"ok": not bad, "bad": {str(k): v for k, v in bad.items()}}
    errors = {str(r): rep["error"] for r, rep in reports.items() if rep is not None and rep.get("error")}
    return {"world": world, "backend": backend, "ops": ops, "errors": errors, "launch_error": launch_error}


def collective_rows(result: dict) -> list[Row]:
    """Table rows: one per op. At world 1 the rows are `not tested` (the output equals the input
    whatever the collective computes), except a failure to run, which is still a FAIL."""
    world, backend = result["world"], result["backend"]
    dtypes = "/".join(str(d).removeprefix("torch.") for d in dtypes_for(world))
    if world == 1:
        group = Row(f"{backend} process group", "world 1 (one GPU): initialised, launched, torn down",
                    "no values can be exchanged", OK if _all_ok(result) else FAIL)
    else:
        group = Row(f"{backend} process group", f"world {world}, one process per GPU, {dtypes}",
                    "every rank's values exact", OK if _all_ok(result) else FAIL)
    rows = [group]
    errors = [f"rank {r}: {e.strip().splitlines()[-1]}" for r, e in sorted(result["errors"].items())]
    if result["launch_error"] or errors:
        rows.append(Row("  errors", "; ".join(filter(None, [result["launch_error"], *errors]))[:160], "none", FAIL))
    for op, verdict in result["ops"].items():
        target = "all ranks exact" if op in OPS else "one-process losses, parameters"
        if not verdict["ok"]:
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(verdict["bad"].items()))
            rows.append(Row(f"  {op}", detail[:160], target, FAIL))
        elif world == 1:
            rows.append(Row(f"  {op}", "ran; at world 1 the output equals the input", "needs >= 2 GPUs", NOT_TESTED))
        else:
            rows.append(Row(f"  {op}", f"all {world} ranks {'exact' if op in OPS else 'reproduce it'}", target, OK))
    for op in (op for op in OPS + tuple(engine_parity.LAYOUTS) if op not in result["ops"]):
        rows.append(Row(f"  {op}", "not run: a world of one has nothing to compare", "needs >= 2 GPUs", NOT_TESTED))
    return rows


def _all_ok(result: dict) -> bool:
    return all(v["ok"] for v in result["ops"].values()) and not result["errors"] and not result["launch_error"]
