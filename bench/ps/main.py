"""Parameter server against collective data parallelism: bytes moved, and loss against wall time
for bsp, ssp and asp, without and with a straggler.

    .venv/bin/python -m bench.ps [--workers 4] [--servers 2] [--steps 80] [--staleness 3] [--slow 0.2]
                                 [--quick] [--json PATH] [--docs docs/benchmarks.md] [--plot docs/ps-loss-wall.png]

One run trains the same model on the same global batch and the same samples (bench/ps/runs.py):
collective data parallelism (the engine at dp D on gloo ranks, the anchor), and parameter-server
jobs (D workers, K servers on the embedded local Ray) with bsp, ssp (bound --staleness) and asp;
each once without a straggler and once with worker (rank) 1 sleeping --slow seconds every step.
It reports (bench/ps/analysis.py):
  * bytes per step: measured by the servers' payload counters (PSReport.bytes_per_step), total and
    per server, next to 2DS and 2DS/K; under ssp and asp the embedding is sparse, and the formula's
    S is the dense parameters plus the rows the step's tokens touched with their ids (counted from
    the data, not from the counters); ring all-reduce's 2(D-1)/D S per rank is computed (the
    collective run has no byte counter);
  * per run: wall time of steps 2..N, from when every worker (rank) finished its first step (the
    start-up of actors and processes, and the first step's waits on it, left out), and that over
    N - 1 as the mean step, against the collective run of the same straggler setting; the loss at
    the end (token-weighted over the last 5 steps of every worker, in finishing order); the
    staleness of the applied updates; and the wall time at which that smoothed loss first reaches
    bsp's final loss, within 1e-5 (bsp's arithmetic does not depend on timing: one target for both
    settings; collective dp equals it to summation order).
It prints the tables, writes --json, draws --plot and rewrites its section of --docs (notes
between the NOTES markers are kept). --quick: 2 workers, 1 server, 8 steps, straggler runs only,
nothing written unless asked: a smoke test of about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.docs import write_section
from bench.ps import analysis, runs
from bench.ps.analysis import Run

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Parameter server against collective data parallelism"
NOTES = ("<!-- ps-notes: kept when python -m bench.ps rewrites this section -->", "<!-- /ps-notes -->")
WINDOW_STEPS = 5
STRAGGLER = 1  # the worker (rank) slowed
# The tiny preset with a larger, untied vocabulary, so that the sparse embedding path has rows to skip.
MODEL = {"preset": "tiny", "vocab_size": 2048, "tie_embeddings": False}


def measure(job: dict, settings: list[bool], slow_s: float) -> tuple[list[Run], dict]:
    """Every run of every straggler setting; the ps reports' byte counters by consistency."""
    out, counters = [], {}
    for straggler in settings:
        slow = {STRAGGLER: slow_s} if straggler else {}
        print(f"collective dp{job['workers']}, straggler {straggler}", flush=True)
        ranks = runs.run_collective(job, slow)
        out.append(Run("collective dp", straggler, job["steps"], analysis.collective_events(ranks), WINDOW_STEPS))
    with runs.local_ray(job):
        for straggler in settings:
            slow = {STRAGGLER: slow_s} if straggler else {}
            for consistency in ("bsp", "ssp", "asp"):
                print(f"ps {consistency}, straggler {straggler}", flush=True)
                report = runs.run_parameter_server(job, consistency, slow)
                mode = f"ps ssp s={job['staleness']}" if consistency == "ssp" else f"ps {consistency}"
                out.append(Run(mode, straggler, job["steps"], analysis.ps_events(report.steps),
                               WINDOW_STEPS * job["workers"],
                               [r.staleness for r in report.records]))
                total, per_server = report.bytes_per_step()
                counters.setdefault(consistency, {"total": total, "per_server": per_server,
                                                  "shard_bytes": report.shard_bytes})
    return out, counters


def byte_rows(job: dict, counters: dict, sizes: dict, rows_touched: list[int]) -> list[dict]:
    d, k, s = job["workers"], job["servers"], sizes["state"]
    out = []
    if "bsp" in counters:
        c = counters["bsp"]
        out.append({"what": "ps bsp (dense), all servers", "measured": c["total"], "formula_text": "2DS",
                    "formula": analysis.ps_total(d, s)})
        for server, (measured, shard) in enumerate(zip(c["per_server"], c["shard_bytes"], strict=True)):
            out.append({"what": f"ps bsp, server {server} (its shard {shard / 1e6:.3f} MB)", "measured": measured,
                        "formula_text": "2DS/K", "formula": analysis.ps_per_server(d, s, k)})
    rows = statistics.mean(rows_touched)
    sparse_s = analysis.sparse_state_bytes(s - sizes["embedding"], rows, sizes["row"])
    for consistency in ("ssp", "asp"):
        if consistency in counters:
            out.append({"what": f"ps {consistency} (sparse embedding), all servers", "measured":
                        counters[consistency]["total"], "formula_text": f"2DS', S' = S - embedding + {rows:.0f} "
                        f"rows x ({sizes['row']} + 8) B", "formula": analysis.ps_total(d, sparse_s)})
    out.append({"what": "ps, per worker (dense)", "measured": None, "formula_text": "2S", "formula": 2 * s})
    out.append({"what": "ring all-reduce, per rank", "measured": None, "formula_text": "2(D-1)/D S",
                "formula": analysis.ring_per_rank(d, s)})
    return out


def docs_section(result: dict) -> str:
    job, m = result["job"], result["machine"]
    model = ", ".join(f"{k}={v}" for k, v in job["model"].items())
    plot = f"\n![loss against wall time]({result['plot_link']})\n" if result.get("plot_link") else ""
    return f"""{SECTION}

Measured by `python -m bench.ps` on {result['date']} in {result['wall_s']:.0f} s. Command:

```bash
{result['command']}
```

Machine: {m['cores']} cores, {m['versions']}; the 1-minute load average was {min(result['loads']):.1f} to
{max(result['loads']):.1f} during the run. Job: model {model} (S = {result['sizes']['state'] / 1e6:.3f} MB of
fp32 parameters); sequence length {job['seq_len']}, global batch {job['global_batch']}, micro-batch
{job['micro_batch']}, lr {job['lr']}, {job['steps']} steps; D = {job['workers']} workers (ranks), K =
{job['servers']} servers, ssp bound {job['staleness']}. Straggler: {result['straggler_text']}. See
bench/ps/main.py for what each number is.

{result['bytes_table']}

{result['run_table']}
{plot}"""


def run(args, command: str) -> dict:
    job = {"model": MODEL, "seq_len": 64, "global_batch": 8, "micro_batch": 2, "steps": args.steps,
           "lr": 3e-3, "workers": args.workers, "servers": args.servers, "staleness": args.staleness}
    settings = [True] if args.quick else [False, True]
    started, loads = time.perf_counter(), [os.getloadavg()[0]]
    measured, counters = measure(job, settings, args.slow)
    loads.append(os.getloadavg()[0])
    sizes = runs.state_bytes(job)
    target = next(r.final_loss for r in measured if r.mode == "ps bsp")
    straggler_text = f"worker {STRAGGLER} sleeps {args.slow:g} s per step"
    rows = analysis.rows(measured, target)
    import torch

    return {"command": command, "date": time.strftime("%Y-%m-%d"), "job": job, "sizes": sizes, "loads": loads,
            "machine": {"cores": os.cpu_count(), "versions": f"{platform.system()} {platform.release()}, Python "
                        f"{platform.python_version()}, torch {torch.__version__}"},
            "straggler_text": straggler_text, "target_loss": target, "wall_s": time.perf_counter() - started,
            "bytes_table": analysis.bytes_table(byte_rows(job, counters, sizes, runs.touched_rows(job))),
            "rows": rows, "run_table": analysis.run_table(rows, straggler_text, target), "runs": measured}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="D: ps workers and collective dp ranks")
    parser.add_argument("--servers", type=int, default=2, help="K: ps server actors")
    parser.add_argument("--steps", type=int, default=80, help="training steps of every run")
    parser.add_argument("--staleness", type=int, default=3, help="ssp's bound")
    parser.add_argument("--slow", type=float, default=0.2, help="seconds the straggler sleeps per step")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 workers, 1 server, 8 steps, "
                        "straggler runs only, nothing written unless --json / --docs / --plot say so")
    parser.add_argument("--json", default=None, help="results file (default runs/bench/ps.json; '' to skip)")
    parser.add_argument("--docs", default=None, help="markdown to update (default docs/benchmarks.md; '' to skip)")
    parser.add_argument("--plot", default=None, help="loss against wall time PNG (default docs/ps-loss-wall.png)")
    args = parser.parse_args(argv)
    if args.quick:
        args.workers, args.servers, args.steps = 2, 1, 8
    defaults = ("", "", "") if args.quick else ("runs/bench/ps.json", "docs/benchmarks.md", "docs/ps-loss-wall.png")
    for name, default in zip(("json", "docs", "plot"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.chdir(ROOT)
    command = shlex.join([".venv/bin/python", "-m", "bench.ps", *(argv if argv is not None else sys.argv[1:])])
    print(f"$ {command}", flush=True)
    result = run(args, command)
    print(f"\n{result['bytes_table']}\n\n{result['run_table']}\n\nwall {result['wall_s']:.0f} s", flush=True)
    if args.plot:
        from bench.ps.plot import plot_loss_wall

        plot_loss_wall(result["runs"], result["target_loss"], result["straggler_text"], args.plot,
                       f"D={args.workers} workers, K={args.servers} servers, {args.steps} steps")
        docs_dir = (ROOT / (args.docs or "docs/benchmarks.md")).parent
        result["plot_link"] = os.path.relpath(ROOT / args.plot, docs_dir)
        print(f"plot: {args.plot}")
    if args.json:
        (ROOT / args.json).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / args.json).write_text(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))
        print(f"results: {args.json}")
    if args.docs:
        write_section(ROOT / args.docs, SECTION, docs_section(result), NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0
