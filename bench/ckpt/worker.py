"""One rank of bench.ckpt: build the sharded state, run every operation of the plan, report timings.

    python -m bench.ckpt.worker CONFIG.json      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
                                                  from the repository root)

Started by the driver (bench/ckpt/main.py) once per rank. The ranks form a gloo group with one
intra-op thread each (4 ranks on 2 cores), build the state (bench/ckpt/state.py), then run
`bench.ckpt.ops.plan(...)` in order. After each operation the ranks' timings are gathered to
rank 0 (outside the timed region); the first repeat's loads are bit-checked. Rank 0 then
runs the thread-vs-process trials (bench/ckpt/tvp.py) on its shard for each backend while
the others wait, and writes everything to the config's `out` file.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.ckpt.ops import Backend, RankOps, plan
from bench.ckpt.state import BenchState


def run(config: dict) -> dict:
    build_start = time.time()
    state = BenchState(config["size_bytes"], config["width"])
    dist.barrier()
    build_s = time.time() - build_start
    backends = {name: Backend(name, **b) for name, b in config["backends"].items()}
    ops = RankOps(state, backends, config["store_host"], config["store_port"])
    ops.warm_up()
    records, last_sync, steps = [], {}, {}
    for op in plan(list(backends), config["repeats"], config["layouts"]):
        kind, backend, check = op["op"], op["backend"], op["rep"] == 0
        if kind.startswith("ours_") and "step" in op:
            timing = ops.ours_save(op)
            steps.setdefault((backend, op["rep"]), []).append(op["step"])
            if kind == "ours_sync":
                last_sync[backend] = op["step"]
        elif kind in ("dcp_save", "dcp_async"):
            timing = ops.dcp_save(op)
        elif kind == "ours_load":
            timing = ops.ours_load(op, last_sync[backend], check)
        elif kind == "dcp_load":
            timing = ops.dcp_load(op, check)
        else:
            timing = ops.raw_read(op, last_sync[backend])
        gathered = [None] * state.world
        dist.all_gather_object(gathered, timing)
        records.append({**op, "ranks": gathered})
        if state.rank == 0:
            print(f"[ckpt bench] {_describe(op, gathered)}", flush=True)
        if kind == "raw_read":  # last operation of the repeat
            ops.clean(backend, steps[(backend, op["rep"])])
    for writer in ops.writers.values():
        writer.flush()
    tvp = {}
    if config["tvp_repeats"] > 0:
        if state.rank == 0:
            for name, backend in backends.items():
                tvp[name] = _tvp(backend, state, config)
                print(f"[ckpt bench] thread vs process on {name}: "
                      + ", ".join(f"{w} lost {r['median_lost']:.3f} s write {r['median_write']:.2f} s"
                                  for w, r in tvp[name]["writers"].items()), flush=True)
        dist.barrier()
    return {"build_s": build_s, "total_bytes": state.total_bytes(), "layers": len(state.model.layers),
            "records": records, "tvp": tvp, "errors": ops.errors}


def _tvp(backend: Backend, state: BenchState, config: dict) -> dict:
    from bench.ckpt.tvp import measure

    url = f"{backend.ours.rsplit('/', 1)[0]}/tvp"
    # Rank 0's pieces, marked unreplicated: the trial writes all of them (the scalars too).
    slices = [replace(piece, replica=0, replicas=1) for piece in state.our_slices()]
    return measure(url, backend.options, state.rank, slices, config["tvp_repeats"])


def _describe(op: dict, ranks: list[dict]) -> str:
    start = min(r["start"] for r in ranks)
    end = max(r["end"] for r in ranks)
    text = f"{op['backend']} rep {op['rep']} {op['op']}{' ' + op['layout'] if 'layout' in op else ''}: " \
           f"total {end - start:.3f} s"
    if "blocking" in ranks[0]:
        text += f", blocking {max(r['blocking'] for r in ranks):.3f} s"
    return text


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    try:
        result = run(config)
        if rank == 0:
            Path(config["out"]).write_text(json.dumps(result))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed rank must not leave the others waiting in a collective for 30 minutes
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
