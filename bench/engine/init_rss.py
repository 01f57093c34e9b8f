"""Peak resident memory of each rank while it builds its engine, against the share it holds.

    .venv/bin/python -m bench.engine.init_rss [--model llama3.2-1b] [--dp 4] [--tp 1] [--zero 3]
                                              [--no-whole] [--json PATH]

Each of dp x tp local processes (gloo, one thread each: tests.dist._launch.run_ranks) records
its peak RSS (`ru_maxrss`) just before constructing its `Engine` (torch and the trainer
imported, the process group up: the rank's fixed overhead) and right after (the peak during
the build; the optimizer state is created at the first step, so the build holds parameters
and buffers only). Its share is the bytes of the local tensors it holds after the build:
parameter storages (FSDP2's padded shards, tensor-parallel splits) and buffers (the RoPE
tables). The bound checked is peak <= overhead + 1.3 x share. Beside it, for scale: an empty
process with torch imported, and (unless --no-whole) one process building the whole model with
`trainer.model.build_model`, which is what every rank did before sharded initialisation.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

BOUND = 1.3
MB = 1 << 20


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def held_bytes(module) -> int:
    """Bytes of the distinct storages behind `module`'s parameters (local shards) and buffers."""
    from trainer.dtensor_slices import local

    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def build_rank(rank: int, world_size: int, model: str, dp: int, tp: int, zero: int) -> dict:
    """Runs in each rank's process (run_ranks): build the engine, report the memory figures."""
    from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from trainer.engine import Engine

    before = _peak_bytes()
    started = time.perf_counter()
    train = TrainConfig(steps=1, global_batch=dp, micro_batch=1)
    engine = Engine(ModelConfig(preset=model), DataConfig(seq_len=128), train,
                    ParallelConfig(dp=dp, tp=tp, zero=zero), rank=rank, world_size=world_size)
    return {"rank": rank, "overhead": before, "peak": _peak_bytes(), "share": held_bytes(engine.model),
            "build_s": time.perf_counter() - started}


def _child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def empty_process() -> dict:
    """An empty process with torch (and the trainer) imported: its peak RSS."""
    return _child("import json, resource, torch, trainer.engine\n"
                  "print(json.dumps({'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def whole_model(model: str) -> dict:
    """One process building the whole model (the path every rank took before): peak RSS and bytes."""
    return _child(
        "import json, resource, time, torch\n"
        "torch.set_num_threads(1)\n"
        "from bench.engine.init_rss import held_bytes\n"
        "from trainer.config import ModelConfig\n"
        "from trainer.model import build_model\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "t = time.perf_counter()\n"
        f"m = build_model(ModelConfig(preset={model!r}), seed=0)\n"
        "print(json.dumps({'overhead': before, 'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,"
        " 'share': held_bytes(m), 'build_s': time.perf_counter() - t}))")


def table(rows: list[dict], empty: dict, whole: dict | None) -> str:
    head = ("| process | fixed overhead | peak RSS | share held | (peak - overhead) / share | build s | "
            f"peak <= overhead + {BOUND} x share |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = (row["peak"] - row["overhead"]) / row["share"]
        ok = row["peak"] <= row["overhead"] + BOUND * row["share"]
        lines.append(f"| {row['name']} | {row['overhead'] / MB:,.0f} MiB | {row['peak'] / MB:,.0f} MiB | "
                     f"{row['share'] / MB:,.0f} MiB | {ratio:.2f} | {row['build_s']:.1f} | {'yes' if ok else 'NO'} |")
    lines.append(f"| empty process, torch imported | - | {empty['peak'] / MB:,.0f} MiB | - | - | - | - |")
    if whole is not None:
        ratio = (whole["peak"] - whole["overhead"]) / whole["share"]
        lines.append(f"| whole model, one process (the old per-rank path) | {whole['overhead'] / MB:,.0f} MiB | "
                     f"{whole['peak'] / MB:,.0f} MiB | {whole['share'] / MB:,.0f} MiB | {ratio:.2f} | "
                     f"{whole['build_s']:.1f} | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b", help="a preset name (trainer/config.py)")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--no-whole", action="store_true", help="skip the one-process whole-model build")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    from tests.dist._launch import run_ranks

    results = run_ranks(build_rank, args.dp * args.tp, args=(args.model, args.dp, args.tp, args.zero),
                        timeout_s=900.0)
    rows = [dict(r, name=f"rank {r['rank']} (dp{args.dp} tp{args.tp} zero{args.zero})") for r in results]
    empty = empty_process()
    whole = None if args.no_whole else whole_model(args.model)
    print(f"{args.model}, dp={args.dp} tp={args.tp} zero={args.zero}: peak RSS while building the engine")
    print(table(rows, empty, whole))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"ranks": rows, "empty": empty, "whole": whole}, handle, indent=1)
    bad = [r for r in rows if r["peak"] > r["overhead"] + BOUND * r["share"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
