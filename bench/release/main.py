"""Release from a broken collective: how fast every survivor leaves its collective when a rank dies.

    .venv/bin/python -m bench.release [--world-sizes 4 8] [--repeats 3] [--cap 3] [--modes ...]

Runs every scenario of bench/release/scenario.py (one collective, W gloo ranks, rank 1 SIGKILLs
itself while the others are inside the collective) in every mode (abort, watcher and the
destroy / idle baselines) and measures release (kill -> last survivor out) and re-form (last
out -> a new group of W-1 ranks checked). Prints a table (median and max over --repeats),
writes runs/bench/release.json and replaces its own section of docs/benchmarks.md.
tests/dist/test_comm_release.py runs the same scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from bench.docs import median_max, ms, replace_section
from bench.release.scenario import COLLECTIVES, HOLD_S, MODES, PAUSE_S, PG_TIMEOUT_S, WARMUP, run_scenario

ROOT = Path(__file__).resolve().parents[2]

SECTION = "## Release from a broken collective"
NOTES = ("<!-- release-notes: kept when python -m bench.release rewrites this section -->", "<!-- /release-notes -->")


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

Measured by `python -m bench.release` on {time.strftime("%Y-%m-%d")}. Command:

```bash
{command}
```

Machine: {os.cpu_count()} cores, no GPU; Python {platform.python_version()}, torch {torch.__version__}, gloo on
127.0.0.1, one intra-op thread per rank, ranks forked from a forkserver; 1-minute load average
{os.getloadavg()[0]:.1f} when the run ended (what else ran, if anything, is said in the notes).

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
    parser = argparse.ArgumentParser(prog="python -m bench.release", description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap", type=float, default=3.0, help="seconds the baselines are watched for")
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=list(COLLECTIVES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", default="runs/bench/release.json")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python -m bench.release", *map(shlex.quote, sys.argv[1:])])

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
