"""Data throughput: `undying data prepare` against one-process tokenizing, and the streaming loader.

    .venv/bin/python -m bench.data [--mib 64] [--rounds 3] [--loader-tokens 40000000] [--backends file s3]
                                   [--json PATH] [--docs docs/benchmarks.md]

One run measures, side by side (bench/data/prepare.py, bench/data/loader.py):
  * preparation: the same generated .jsonl corpus (--mib MiB) and BPE tokenizer, tokenized by a
    one-process `tokenizers` loop (the anchor), by `encode_batch` in one process, by `undying
    data prepare` on an embedded Ray (Ray Data; end to end, and from its workers being up), and
    by `undying data prepare --address` a standing local Ray cluster of this machine's cores (its
    nodes started before the clock, as a cluster user's are); the token streams must be equal.
    The loop and ours run --rounds times alternately, each reported by its median, with the range
    of the rounds' own ratios. Target: >= 1.6x the loop on 2 cores;
  * the loader, per backend (file://, and s3:// on a SeaweedFS server this script starts on
    loopback ports and stops by PID): cold windows/s and tokens/s one rank reads, against the
    tokens/s the tiny model's training step consumes, and the data wait per step with the default
    prefetch, as a fraction of the step time. Target: under 1% for the tiny model on s3://.
It prints the table, writes --json and rewrites its section of --docs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from bench.data.loader import measure_loader
from bench.data.prepare import measure_prepare
from bench.docs import replace_section

SECTION = "## Data: preparation and the streaming loader"
NOTES = ("<!-- data-notes: kept when python -m bench.data rewrites this section -->", "<!-- /data-notes -->")


def _ratio(p: dict, key: str) -> str:
    """The median loop over the median `key`, and the range of the rounds' own ratios."""
    spread = [r["loop_s"] / r[key] for r in p["rounds"]]
    return f"{p['loop_s'] / p[key]:.2f}x ({min(spread):.2f}-{max(spread):.2f}x)"


def table(result: dict) -> str:
    p = result["prepare"]
    n = len(p["rounds"])
    rows = [
        f"| tokenizing | seconds | tokens/s | vs the loop (the {n} rounds' range) |",
        "|---|---|---|---|",
        f"| one-process `tokenizers` loop (anchor), median of {n} | {p['loop_s']:.1f} | "
        f"{p['tokens'] / p['loop_s']:,.0f} | 1.00x |",
        f"| one process, `encode_batch`, once | {p['batch_s']:.1f} | {p['tokens'] / p['batch_s']:,.0f} | "
        f"{p['loop_s'] / p['batch_s']:.2f}x |",
        f"| one process, `encode_batch_fast` (no offsets), once | {p['fast_s']:.1f} | "
        f"{p['tokens'] / p['fast_s']:,.0f} | {p['loop_s'] / p['fast_s']:.2f}x |",
        f"| `undying data prepare`, Ray Data, end to end, median of {n} | {p['ours_s']:.1f} | "
        f"{p['tokens'] / p['ours_s']:,.0f} | **{_ratio(p, 'ours_s')}** |",
        f"| `undying data prepare`, from workers up, median of {n} | {p['ours_after_startup_s']:.1f} | "
        f"{p['tokens'] / p['ours_after_startup_s']:,.0f} | {_ratio(p, 'ours_after_startup_s')} |",
        f"| `undying data prepare --address` a running Ray cluster, end to end, median of {n} | "
        f"{p['ours_cluster_s']:.1f} | {p['tokens'] / p['ours_cluster_s']:,.0f} | **{_ratio(p, 'ours_cluster_s')}** |",
        "",
        f"{p['corpus_mib']:.0f} MiB of .jsonl, {p['documents']:,} documents, {p['tokens']:,} tokens; every "
        f"stream equal: {p['same_stream']}.",
        "",
        "| loader (one rank of dp 4, tiny model, seq 256) | cold windows/s | cold tokens/s | training consumes "
        "tokens/s | read / consumed | step | data wait per step | wait / step time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["loader"].items():
        rows.append(f"| {name}:// | {r['windows_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['consumed_tokens_per_s']:,.0f} | {r['tokens_per_s'] / r['consumed_tokens_per_s']:.1f}x | "
                    f"{r['step_s'] * 1e3:.0f} ms | {r['wait_ms_median']:.2f} ms | **{r['wait_fraction']:.2%}** |")
    return "\n".join(rows)


@contextlib.contextmanager
def standing_cluster():
    """A local Ray cluster (a head and one node of this machine's cores) for the duration; its
    address. Stopped by the PIDs of its own processes (tests/ray/_multinode.py), never `ray stop`."""
    from tests.ray._multinode import LocalCluster

    cluster = LocalCluster(nodes=1, cpus_per_node=os.cpu_count() or 2)
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="undying-bench-data-") as tmp:
        work = Path(tmp)
        result = {"prepare": measure_prepare(work / "prepare", args.mib, standing_cluster, args.rounds)}
        server = None
        if "s3" in args.backends:
            from tests.s3._seaweed import start_seaweed

            server = start_seaweed(work / "seaweedfs")
        try:
            result["loader"] = measure_loader(work / "loader", server, args.loader_tokens)
        finally:
            if server is not None:
                server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="corpus size for the preparation (default 64)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of the loop and of ours, alternately; each reported by its median (default 3)")
    parser.add_argument("--loader-tokens", type=int, default=40_000_000, help="tokens of the loader's dataset")
    parser.add_argument("--backends", nargs="+", default=["file", "s3"], choices=("file", "s3"))
    parser.add_argument("--json", help="write the raw result here")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="rewrite this file's section ('' to skip)")
    args = parser.parse_args(argv)
    result = run(args)
    text = table(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.docs:
        command = "python -m bench.data " + shlex.join(argv if argv is not None else sys.argv[1:])
        section = (f"{SECTION}\n\n`{command.strip()}` ({platform.machine()}, {os.cpu_count()} cores, 1-minute load "
                   f"average {os.getloadavg()[0]:.1f} at the end; what else ran, if anything, is said in the notes); "
                   f"see bench/data/main.py for what each row measures.\n\n{text}\n")
        docs = Path(args.docs)
        if NOTES[0] not in (docs.read_text() if docs.exists() else ""):
            section += f"\n{NOTES[0]}\n{NOTES[1]}\n"
        replace_section(docs, SECTION, section, NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0
