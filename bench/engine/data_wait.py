"""The per-step cost of sharing the data wait (trainer.data_wait.slowest_wait) against the
all-reduce every step already makes, side by side on the same ranks.

    .venv/bin/python -m bench.engine.data_wait [--worlds 2 4] [--calls 2000]

Each world runs W local processes (gloo, one thread each: tests.dist._launch.run_ranks). Every
rank alternates, `--calls` times each, the two collectives of a data-parallel step's start: the
anchor, the engine's token count (an int64 SUM over the dp group, here the whole world), and
`slowest_wait` (a float64 MAX over the job). Per world it prints the median over ranks of each
call's mean time and their ratio. Alternating the two, each first in every other pair, puts any
slowdown of the machine and the ranks' arrival skew on both alike.
On a machine with fewer cores than ranks, both are dominated by the ranks waiting for a core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from trainer.data_wait import slowest_wait

WARMUP = 50


def _rank(rank: int, world: int, calls: int) -> tuple[float, float]:
    """Run on every rank: (seconds per token-count all-reduce, seconds per slowest_wait). Their order
    alternates: the first collective of a pair also absorbs the ranks' arrival skew, which would
    otherwise always fall on the same one."""
    cpu = torch.device("cpu")

    def count_tokens() -> None:
        total = torch.tensor([100 + rank], dtype=torch.int64)
        dist.all_reduce(total)
        int(total)

    def share_wait() -> None:
        slowest_wait(0.001 * rank, world, cpu)

    spent = {count_tokens: 0.0, share_wait: 0.0}
    for i in range(WARMUP + calls):
        for call in ((count_tokens, share_wait) if i % 2 == 0 else (share_wait, count_tokens)):
            started = time.perf_counter()
            call()
            if i >= WARMUP:
                spent[call] += time.perf_counter() - started
    return spent[count_tokens] / calls, spent[share_wait] / calls


def measure(world: int, calls: int) -> dict:
    from tests.dist._launch import run_ranks

    per_rank = run_ranks(_rank, world, args=(calls,), timeout_s=60 + calls * world * 0.01)
    count = statistics.median(c for c, _ in per_rank)
    share = statistics.median(s for _, s in per_rank)
    return {"world": world, "count_us": count * 1e6, "wait_us": share * 1e6, "ratio": share / count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    print("| ranks | token-count all-reduce (anchor) | slowest_wait | ratio |")
    print("|---|---|---|---|")
    for world in args.worlds:
        row = measure(world, args.calls)
        print(f"| {world} | {row['count_us']:.0f} µs | {row['wait_us']:.0f} µs | {row['ratio']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
