"""The prepared GPU check: NCCL collectives, bf16 training steps, step time and MFU.

Run on a machine with an NVIDIA GPU (`make gpu-check`, or `python -m bench.gpu_check`).
It prints one table and writes `$OUT/gpu_check.json` (or `runs/gpu_check.json`):

  * matmul peak: measured bf16 TFLOP/s of a large GEMM, beside the table value for the
    device (H100/H200/A100), so MFU is reported against both;
  * NCCL: a single-process NCCL group (world 1) all-reduce, all-gather and reduce-scatter
    round trip, which proves the NCCL path (init, abort-free teardown) works on this image;
  * checkpoint staging: 1 GiB of device tensors staged by `ckpt.staging.StagingPool` (pinned
    host buffers, asynchronous copies): exact, pinned, and the warm copy's GB/s; and the same
    state saved by `ckpt.process_writer.ProcessShardWriter` (memfd buffer page-locked for
    CUDA): pinned, the warm blocking time, and the shard loaded back equal to the device state;
  * training: the engine's GPT (`small` preset unless --preset) for --steps bf16 steps on one
    GPU, with step time, tokens/s and MFU = achieved model FLOP/s / peak;
  * memory: a 1B-class model (--mem-preset) for a few bf16 steps at tp = 1, without and with
    recomputation (--mem-recompute), its `torch.cuda.max_memory_allocated` beside the cost
    model's predicted peak (trainer.costmodel.memory ledgers; the target is within 15 %).
    A mismatch is printed and recorded, not turned into a failing exit code: the ledgers'
    allowances are calibrated from these numbers.

On a machine without CUDA it says so and exits 3, so it cannot be mistaken for a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Dense bf16 peak (no sparsity), TFLOP/s, by device-name fragment.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0}


def table_peak(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def measured_matmul_tflops(torch, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def nccl_roundtrip(torch) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    x = torch.ones(1 << 20, device="cuda")
    started = time.perf_counter()
    dist.all_reduce(x)
    out = [torch.empty_like(x)]
    dist.all_gather(out, x)
    rs = torch.empty_like(x)
    dist.reduce_scatter(rs, [x])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    ok = bool(torch.equal(rs, x))
    dist.destroy_process_group()
    return {"ok": ok, "seconds": elapsed}


def train_steps(torch, preset: str, steps: int, seq_len: int, micro_batch: int) -> dict:
    from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from trainer.engine import Engine
    from trainer.model import flops_per_token

    model = ModelConfig(preset=preset)
    data = DataConfig(seq_len=seq_len, min_len_fraction=1.0)
    train = TrainConfig(steps=steps, global_batch=micro_batch, micro_batch=micro_batch, precision="bf16",
                        deterministic=False)
    engine = Engine(model, data, train, ParallelConfig(), rank=0, world_size=1, device="cuda")
    times, tokens = [], 0
    for i in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = engine.train_step()
        torch.cuda.synchronize()
        if i >= 2:  # warm-up steps excluded
            times.append(time.perf_counter() - started)
            tokens += result.tokens
    step_s = sum(times) / len(times)
    tok_s = tokens / sum(times)
    return {"preset": preset, "step_s": step_s, "tokens_per_s": tok_s,
            "model_tflops": tok_s * flops_per_token(model, seq_len) / 1e12, "loss": result.loss}


def memory_check(torch, preset: str, seq_len: int, micro_batch: int, recompute: str, steps: int = 3) -> dict:
    """Peak memory of `steps` bf16 steps at dp = tp = pp = 1 beside the cost model's four ledgers.

    The peak is read over the engine's whole life (built after a reset of the peak counters), so it
    covers the first optimizer step, where the AdamW state appears, and later steps that hold that
    state and a full set of activations together. The ledgers model what the caching allocator
    reserves (trainer.costmodel.memory), so the reserved peak is printed next to the allocated one.
    """
    import gc

    from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from trainer.costmodel.layout import Layout, Workload
    from trainer.costmodel.memory import ledgers
    from trainer.engine import Engine

    model = ModelConfig(preset=preset)
    data = DataConfig(seq_len=seq_len, min_len_fraction=1.0)
    train = TrainConfig(steps=steps, global_batch=micro_batch, micro_batch=micro_batch, precision="bf16",
                        deterministic=False)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(model, data, train, ParallelConfig(recompute=recompute), rank=0, world_size=1, device="cuda")
    for _ in range(steps):
        engine.train_step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    work = Workload(model=model, seq_len=seq_len, global_batch=micro_batch, precision="bf16")
    predicted = ledgers(work, Layout(micro_batch=micro_batch, recompute=recompute), "gpu")
    ratio = predicted.total / measured
    return {"preset": preset, "seq_len": seq_len, "micro_batch": micro_batch, "recompute": recompute,
            "max_memory_allocated": measured, "max_memory_reserved": reserved,
            "predicted": predicted.to_json(), "predicted_over_measured": ratio,
            "within_15pct": abs(ratio - 1) <= 0.15}


def staging_check(torch, mib: int = 1024, saves: int = 3) -> dict:
    """The checkpoint writer's staging of device state: pinned host buffers, exact copies, GB/s."""
    from ckpt.staging import StagingPool
    from trainer.state_slices import whole

    pieces = [whole(f"w{i}", torch.randn(1 << 20, 16, device="cuda")) for i in range(mib // 64)]
    pool, times = StagingPool(), []
    for _ in range(saves):  # the first save allocates (pins) the buffers, later ones reuse them
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged = pool.stage(pieces)
        times.append(time.perf_counter() - start)
    exact = all(torch.equal(s.tensor, p.tensor.cpu()) for s, p in zip(staged, pieces, strict=True))
    pinned = all(s.tensor.is_pinned() for s in staged)
    return {"mib": mib, "first_s": times[0], "warm_s": min(times[1:]), "gbps": (mib << 20) / min(times[1:]) / 1e9,
            "exact": exact, "pinned": pinned, "reused": pool.reused, "ok": exact and pinned}


def process_writer_check(torch, mib: int = 1024, saves: int = 3) -> dict:
    """The writer process's staging of device state (checkpoint.writer: process, the default on
    object stores): a memfd buffer page-locked for CUDA, asynchronous copies; then the child's
    shards, loaded back, must equal the device tensors."""
    import tempfile

    from ckpt.catalog import Catalog
    from ckpt.process_writer import ProcessShardWriter
    from ckpt.reader import load_checkpoint
    from ckpt.storage import Storage
    from trainer.state_slices import whole

    pieces = [whole(f"w{i}", torch.randn(1 << 20, 16, device="cuda")) for i in range(mib // 64)]
    receipts, errors, blocking = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/job"
        writer = ProcessShardWriter(url, {}, 0, lambda r, extra: receipts.append(r),
                                    lambda step, err: errors.append(f"{step}: {err}"))
        for step in range(1, saves + 1):
            torch.cuda.synchronize()
            blocking.append(writer.save(step, pieces, {}))
            writer.wait()
        pinned = writer._buffer.pinned
        writer.flush()
        exact = False
        if not errors:
            catalog = Catalog(Storage(url))
            catalog.commit(job="j", step=saves, generation=0, layout={}, spec_hash="h",
                           receipts=[receipts[-1]], state={})
            tensors, _ = load_checkpoint(catalog, saves)
            exact = all(torch.equal(tensors[p.name], p.tensor.cpu()) for p in pieces)
    warm = min(blocking[1:])
    return {"mib": mib, "first_s": blocking[0], "warm_s": warm, "gbps": (mib << 20) / warm / 1e9, "pinned": pinned,
            "exact": exact, "errors": errors, "ok": exact and pinned and not errors}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--mem-preset", default="llama3.2-1b", help="model of the memory check ('' to skip it)")
    parser.add_argument("--mem-seq-len", type=int, default=4096)
    parser.add_argument("--mem-micro-batch", type=int, default=1)
    parser.add_argument("--mem-recompute", nargs="+", default=["none", "block"],
                        choices=["none", "selective", "block"])
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing was checked", file=sys.stderr)
        return 3
    name = torch.cuda.get_device_name(0)
    result = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    result["matmul_tflops"] = measured_matmul_tflops(torch)
    result["table_peak_tflops"] = table_peak(name)
    result["nccl_roundtrip"] = nccl_roundtrip(torch)
    result["staging"] = staging = staging_check(torch)
    result["process_writer"] = procw = process_writer_check(torch)
    result["train"] = train_steps(torch, args.preset, args.steps, args.seq_len, args.micro_batch)
    model_tflops = result["train"]["model_tflops"]
    result["memory"] = [memory_check(torch, args.mem_preset, args.mem_seq_len, args.mem_micro_batch, rc)
                        for rc in (args.mem_recompute if args.mem_preset else [])]
    result["mfu_vs_measured"] = model_tflops / result["matmul_tflops"]
    if result["table_peak_tflops"]:
        result["mfu_vs_table"] = model_tflops / result["table_peak_tflops"]
    out_dir = Path(os.environ.get("OUT") or ROOT / "runs")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2))
    rows = [("device", name), ("torch / cuda / nccl", f"{torch.__version__} / {torch.version.cuda} / {result['nccl']}"),
            ("bf16 matmul", f"{result['matmul_tflops']:.0f} TFLOP/s (table {result['table_peak_tflops']})"),
            ("nccl round trip", f"{'ok' if result['nccl_roundtrip']['ok'] else 'WRONG'} "
                                f"{result['nccl_roundtrip']['seconds'] * 1e3:.1f} ms"),
            ("ckpt staging (pinned)", f"{'ok' if staging['ok'] else 'WRONG'} {staging['mib']} MiB warm "
                                      f"{staging['warm_s'] * 1e3:.0f} ms ({staging['gbps']:.1f} GB/s), "
                                      f"first {staging['first_s']:.2f} s"),
            ("ckpt writer process", f"{'ok' if procw['ok'] else 'WRONG'} {procw['mib']} MiB warm "
                                    f"{procw['warm_s'] * 1e3:.0f} ms ({procw['gbps']:.1f} GB/s), "
                                    f"pinned {procw['pinned']}, first {procw['first_s']:.2f} s"),
            (f"{args.preset} bf16 step", f"{result['train']['step_s'] * 1e3:.1f} ms, "
                                          f"{result['train']['tokens_per_s'] / 1e3:.1f}k tok/s"),
            ("MFU", f"{result['mfu_vs_measured']:.1%} of measured, "
                    f"{result.get('mfu_vs_table', float('nan')):.1%} of table peak")]
    for mem in result["memory"]:
        rows.append((f"{mem['preset']} peak rc={mem['recompute']}",
                     f"measured {mem['max_memory_allocated'] / 2**30:.2f} GiB allocated "
                     f"({mem['max_memory_reserved'] / 2**30:.2f} reserved), predicted "
                     f"{mem['predicted']['total'] / 2**30:.2f} GiB = {mem['predicted_over_measured']:.2f}x "
                     f"({'within' if mem['within_15pct'] else 'NOT within'} 15%)"))
    for key, value in rows:
        print(f"{key:22s} {value}")
    return 0 if result["nccl_roundtrip"]["ok"] and result["staging"]["ok"] and procw["ok"] else 1
