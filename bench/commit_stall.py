"""The controller's thread per checkpoint commit on a slow store: the store work inline, or beside it.

    .venv/bin/python -m bench.commit_stall [--latency-ms 0 50 200] [--commits 8] [--ranks 8] [--docs docs/benchmarks.md]

A commit on the controller's thread creates the manifest (and reads it back); after it, retention
and GC list the job's root, stat the manifests and delete the expired and orphaned step
directories. On a slow or throttling object store each of those calls costs its latency, and the
controller, single-threaded, notices no failure, hang or signal meanwhile. This times, side by
side in one run, the controller thread's time per commit (the last receipt's `Committer.on_receipt`,
and with a commit lane the `collect` that settles it) three ways: everything inline; retention and
GC on the housekeeper's thread (ckpt.housekeeping); and the manifest create on the commit lane too,
as the controller runs them now, against a local store whose every call the controller makes is
delayed (chaos `storage_latency` on the catalog's storage only; the ranks' shard writes are not).
`keep` is 2 and every step leaves an unfinished save behind, so each commit's pass deletes one
checkpoint and one orphan. Also shown: when the lane's commit lands (the hand-over to a settled
create), and how long the retention pass takes to settle (off the controller's thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.docs import measured_by, publish, run_facts

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Commit stall on a slow store: the controller's thread per commit"
NOTES = ("<!-- commit-stall-notes: kept when python -m bench.commit_stall rewrites this section -->",
         "<!-- /commit-stall-notes -->")
KEEP = 2
WAYS = ("inline", "beside", "lane")  # what runs off the controller's thread: nothing, retention, the create too


def _receipts(storage, step: int, ranks: int) -> list:
    """Every rank's shard of a small state for `step`, as the ranks write them (no latency)."""
    import torch

    from ckpt.shards import write_slices
    from trainer.state_slices import whole

    return [write_slices(storage, step, rank, [whole(f"model/w{rank}", torch.full((64,), float(step)))], 0.0)
            for rank in range(ranks)]


def measure(latency_s: float, commits: int, ranks: int, way: str) -> dict:
    """Median seconds the controller's thread spent per commit, the lane's commits landing, the passes."""
    from chaos.storage_faults import install
    from ckpt.catalog import Catalog
    from ckpt.commit import Committer
    from ckpt.housekeeping import Housekeeper
    from ckpt.storage import Storage

    with tempfile.TemporaryDirectory(prefix="undying-commit-stall-") as tmp:
        url = f"file://{tmp}/ckpt/job"
        ranks_storage, controller_storage = Storage(url), Storage(url)
        if latency_s > 0:
            install(controller_storage, [{"kind": "storage_latency", "delay_s": latency_s, "at_seconds": 0.0}])
        keeper = Housekeeper("bench-retention") if way != "inline" else None
        lane = Housekeeper("bench-commit") if way == "lane" else None
        committer = Committer(Catalog(controller_storage), "job", "h", KEEP, housekeeper=keeper, lane=lane)
        stalls, lands, settles = [], [], []
        for i in range(commits):
            step = 10 * (i + 1)
            receipts = _receipts(ranks_storage, step, ranks)
            _receipts(ranks_storage, step - 5, 1)  # an unfinished save: the GC's orphan
            for receipt in receipts[:-1]:
                committer.on_receipt(receipt, {"engine": {"next_step": step}}, ranks, 0, {}, lambda s: {})
            started = time.perf_counter()
            commit = committer.on_receipt(receipts[-1], {}, ranks, 0, {}, lambda s: {})
            stalls.append(time.perf_counter() - started)
            if lane is not None:
                if not committer.flush(600):
                    raise AssertionError("the commit lane did not settle")
                lands.append(time.perf_counter() - started)
                collected = time.perf_counter()
                commit = next(iter(committer.collect()), None)
                stalls[-1] += time.perf_counter() - collected
            if commit is None:
                raise AssertionError(f"step {step} did not commit")
            started = time.perf_counter()
            if not committer.settle(600):
                raise AssertionError("the background pass did not settle")
            settles.append(time.perf_counter() - started)
        if Catalog(ranks_storage).committed_steps() != [10 * (commits - 1), 10 * commits]:
            raise AssertionError("retention did not keep the newest two")
        for thread in (keeper, lane):
            if thread is not None:
                thread.close(60)
    return {"stall": statistics.median(stalls), "settle": statistics.median(settles),
            "lands": statistics.median(lands) if lands else None}


def table(rows: list[dict]) -> str:
    lines = ["| latency per call | controller thread per commit: inline | retention beside | create on the lane "
             "too | inline / lane | lane: commit lands after | retention pass (off the thread) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        inline, beside, lane = (row[way]["stall"] for way in WAYS)
        lines.append(f"| {row['latency_ms']:g} ms | {inline * 1e3:.1f} ms | {beside * 1e3:.1f} ms | "
                     f"{lane * 1e3:.2f} ms | {inline / lane:.0f}x | {row['lane']['lands'] * 1e3:.1f} ms | "
                     f"{row['lane']['settle'] * 1e3:.1f} ms |")
    return "\n".join(lines)


def docs_section(result: dict) -> str:
    return f"""{SECTION}

{measured_by("bench.commit_stall", result)}

{os.cpu_count()} cores; a local checkpoint root whose every call from the controller's catalog (manifest create and
read-back, listings, stats, deletes) sleeps the latency first (chaos `storage_latency`), the ranks' shard writes
not; {result['ranks']} ranks, {result['commits']} commits per row (the median shown), `keep` 2 and an unfinished
save beside each step, so every pass deletes a checkpoint and an orphan. The 1-minute load average was
{result['load']:.1f} before the run.

{result['table']}

- inline: `Committer` with no background thread, the manifest create, its read-back, retention and GC in the
  commit; retention beside: with a housekeeper (`ckpt.housekeeping.Housekeeper`), the create still inline; create
  on the lane too: with a commit lane as well, as the controller runs them now (the thread's time is the last
  receipt's hand-over plus the `collect` that settles the commit). The controller notices no failure, hang or
  signal while its thread is in the commit.
- lane: commit lands after: from the hand-over to the create settled (the manifest durable), off the thread.
- retention pass: the median time from the commit to the pass settling, on the housekeeper's thread.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.commit_stall", description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", nargs="+", type=float, default=[0.0, 50.0, 200.0],
                        help="delay of each store call the controller makes")
    parser.add_argument("--commits", type=int, default=8, help="commits per row (the median is shown)")
    parser.add_argument("--ranks", type=int, default=8, help="shards per checkpoint")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    if args.commits < 2 or args.ranks < 1 or min(args.latency_ms) < 0:
        parser.error("--commits at least 2, --ranks at least 1, --latency-ms at least 0")
    os.chdir(ROOT)
    facts = run_facts("bench.commit_stall", argv, os.getloadavg()[0])
    rows = [{"latency_ms": ms, **{way: measure(ms / 1e3, args.commits, args.ranks, way) for way in WAYS}}
            for ms in args.latency_ms]
    result = {**facts, "commits": args.commits, "ranks": args.ranks, "table": table(rows)}
    publish(result["table"], args.docs, SECTION, docs_section(result), NOTES)  # (cwd: the repository root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
