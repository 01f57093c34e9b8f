"""A step's windows read from object storage one by one (the anchor) against as one batch of
concurrent ranged reads (`TokenDataset.read_many`, what the loader does), side by side.

    .venv/bin/python -m bench.data.batched_reads [--steps 60] [--rounds 3]

On a SeaweedFS server this script starts on 127.0.0.1 (tests/s3/_seaweed.py), one prepared dataset
of random ids (bench/data/loader.py); one rank of dp 4 of the loader bench's batch (8 windows of
257 tokens a step). Each round reads `--steps` steps cold both ways, alternately; each way is
reported by its median round. A local server answers a ranged GET in a few milliseconds, a cloud
store in tens: the anchor's cost per step grows with the latency times the windows, the batch's
with the latency times the windows over the client's connections (10 by default).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

SECTION = "## Data: a step's windows in one batch of ranged reads"
NOTES = ("<!-- batched-reads-notes: kept when python -m bench.data.batched_reads rewrites this section -->",
         "<!-- /batched-reads-notes -->")


def steps_spans(cursor, steps: int, first: int) -> list[list[tuple[int, int]]]:
    from bench.data.loader import DP, GLOBAL_BATCH

    return [[(window * cursor.span, cursor.span) for _, window in cursor.windows(step, GLOBAL_BATCH, 0, DP)]
            for step in range(first, first + steps)]


def read_one_by_one(dataset, spans: list[list[tuple[int, int]]]) -> float:
    started = time.perf_counter()
    for step in spans:
        for start, length in step:
            dataset.read(start, length)
    return time.perf_counter() - started


def read_batched(dataset, spans: list[list[tuple[int, int]]]) -> float:
    started = time.perf_counter()
    for step in spans:
        dataset.read_many(step)
    return time.perf_counter() - started


def measure(steps: int, rounds: int) -> dict:
    from bench.data.loader import SEQ, VOCAB, write_dataset
    from tests.s3._seaweed import BUCKET, start_seaweed
    from trainer.config import DataConfig
    from trainer.data import make_cursor

    with tempfile.TemporaryDirectory(prefix="undying-bench-batched-") as tmp:
        server = start_seaweed(Path(tmp) / "seaweedfs")
        try:
            url, options = f"s3://{BUCKET}/{uuid.uuid4().hex}/tokens", server.storage_options
            write_dataset(url, options, 4_000_000)
            cursor = make_cursor(DataConfig(source="tokens", path=url, storage_options=options, seq_len=SEQ), VOCAB)
            dataset = cursor.datasets[0]
            times: dict[str, list[float]] = {"one by one": [], "batched": []}
            for r in range(rounds):  # fresh steps every time: nothing read twice
                times["one by one"].append(read_one_by_one(dataset, steps_spans(cursor, steps, 2 * r * steps)))
                times["batched"].append(read_batched(dataset, steps_spans(cursor, steps, (2 * r + 1) * steps)))
            windows = steps * len(steps_spans(cursor, 1, 0)[0])
        finally:
            server.stop()
    return {"steps": steps, "windows": windows, "rounds": rounds,
            "seconds": {way: sorted(t) for way, t in times.items()}}


def table(result: dict) -> str:
    median = {way: statistics.median(t) for way, t in result["seconds"].items()}
    anchor = median["one by one"]
    rows = ["| reading a rank's step (8 windows of 257 tokens) from S3 | median s | windows/s | ms per step "
            "| vs one by one |", "|---|---|---|---|---|"]
    for way, seconds in median.items():
        rows.append(f"| {way}{' (anchor)' if way == 'one by one' else ', read_many (ours)'} | {seconds:.2f} | "
                    f"{result['windows'] / seconds:,.0f} | {seconds / result['steps'] * 1e3:.1f} | "
                    f"**{anchor / seconds:.2f}x** |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data.batched_reads", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", default="docs/benchmarks.md", help="rewrite this file's section ('' to skip)")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.rounds)
    text = table(result)
    print(text)
    if args.docs:
        from bench.docs import write_section

        command = f"python -m bench.data.batched_reads --steps {args.steps} --rounds {args.rounds}"
        write_section(Path(args.docs), SECTION, f"{SECTION}\n\n`{command}` (each way's median of "
                      f"{args.rounds} rounds, alternately; a SeaweedFS server on 127.0.0.1).\n\n{text}\n", NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
