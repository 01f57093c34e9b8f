"""The controller's heartbeat read at scale: one round trip per rank against one batch.

    .venv/bin/python -m bench.store_reads [--ranks 64 256 1024 4096] [--repeats 7] [--docs docs/benchmarks.md]

Every `monitor.heartbeat_s` (0.5 s by default) the controller reads every rank's heartbeat from
the rendezvous store (orchestrator.controller.telemetry), on the thread that also detects
failures and commits checkpoints. Against a real RendezvousServer holding N sealed heartbeats
(what ranks write), this times, side by side in one run, reading them key by key
(`GenerationStore.get_json`: a `check` and a `get` per rank) and in one batch
(`GenerationStore.get_many_json`: `check` and `multi_get` over all keys), the median of
`--repeats` reads each, and the share of a heartbeat period the read takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.docs import measured_by, publish, run_facts

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Heartbeat reads at scale"
NOTES = ("<!-- store-reads-notes: kept when python -m bench.store_reads rewrites this section -->",
         "<!-- /store-reads-notes -->")
HEARTBEAT_S = 0.5


def measure(ranks: int, repeats: int) -> dict:
    """Median seconds of one read of `ranks` heartbeats, key by key and batched."""
    from orchestrator.wire.store import RendezvousServer, connect, heartbeat_key

    server = RendezvousServer("127.0.0.1")
    controller, writer = server.generation(0), connect(server.address, 0, timeout_s=30)
    keys = [heartbeat_key(r) for r in range(ranks)]
    for rank, key in enumerate(keys):
        writer.set_json(key, {"step": 100, "time": time.time(), "compute_s": 0.25, "rank": rank})
    timings: dict[str, list[float]] = {"per_key": [], "batched": []}
    for _ in range(repeats):
        started = time.perf_counter()
        one_by_one = [controller.get_json(key) for key in keys]
        timings["per_key"].append(time.perf_counter() - started)
        started = time.perf_counter()
        batched = controller.get_many_json(keys)
        timings["batched"].append(time.perf_counter() - started)
        if batched != one_by_one or None in batched:
            raise AssertionError("the batched read disagrees with the key-by-key one")
    return {"ranks": ranks, **{k: statistics.median(v) for k, v in timings.items()}}


def table(rows: list[dict]) -> str:
    lines = ["| ranks | key by key | batched | speed-up | key by key, share of a 0.5 s period | "
             "batched, share |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['ranks']} | {row['per_key'] * 1e3:.1f} ms | {row['batched'] * 1e3:.2f} ms | "
                     f"{row['per_key'] / row['batched']:.0f}x | {row['per_key'] / HEARTBEAT_S:.1%} | "
                     f"{row['batched'] / HEARTBEAT_S:.2%} |")
    return "\n".join(lines)


def docs_section(result: dict) -> str:
    return f"""{SECTION}

{measured_by("bench.store_reads", result)}

{os.cpu_count()} cores; one real rendezvous store (torch TCPStore, libuv) on 127.0.0.1 holding one sealed heartbeat per
rank; the controller's client reads them all, key by key and then batched, {result['repeats']} times each (the
median shown). The 1-minute load average was {result['load']:.1f} before the run.

{result['table']}

- key by key: `GenerationStore.get_json` per rank (a `check` and a `get`: two round trips each), how the controller
  read heartbeats before; batched: `GenerationStore.get_many_json` (`check` and `multi_get` over every key), how it
  reads them now. Both open (verify) every value.
- share of a period: the controller's thread is busy with the read for that part of every heartbeat period
  (`monitor.heartbeat_s`, 0.5 s), and failure detection and commits wait behind it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store_reads", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[64, 256, 1024, 4096], help="heartbeats per read")
    parser.add_argument("--repeats", type=int, default=7, help="reads of each kind per size (the median is shown)")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.ranks) < 1:
        parser.error("--ranks and --repeats: at least 1")
    os.chdir(ROOT)
    facts = run_facts("bench.store_reads", argv, os.getloadavg()[0])
    rows = [measure(n, args.repeats) for n in args.ranks]
    result = {**facts, "repeats": args.repeats, "table": table(rows)}
    publish(result["table"], args.docs, SECTION, docs_section(result), NOTES)  # (cwd: the repository root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
