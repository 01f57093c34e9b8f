"""Engine step time with `train.deterministic` on and off, side by side, on the CPU.

    .venv/bin/python -m bench.engine.deterministic [--model SPEC] [--seq-len 256] [--micro-batch 4]
                                                   [--steps 10] [--warmup 2] [--rounds 3] [--docs PATH]

One process at dp = tp = pp = 1: the per-rank compute every layout runs, without the collectives
(whose reduction order the switch does not touch). Each round builds a fresh engine with
deterministic on (the default, the anchor) and one with it off, in alternating order between
rounds so that neither always runs second on a warm cache, and trains each for --warmup untimed
and --steps timed steps of the same batches. It reports the median step time of each setting
over all rounds, off against on, and whether every round's losses are bitwise equal to the first
"on" round's (on repeating itself, off matching it).

`torch.use_deterministic_algorithms` is process-wide and the engine only ever turns it on
(trainer/engine.py), so an "off" run turns it off itself and puts it back afterwards. The same
comparison on CUDA is a row of `make gpu-check` (bench/gpu_check/training.py), where the switch
picks other kernels (cuBLAS workspace, scatter/index backward).
"""

from __future__ import annotations

import argparse
import gc
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.docs import replace_section
from bench.engine.main import DEFAULT_MODEL, parse_model
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Deterministic kernels: engine step time on and off"
NOTES = ("<!-- deterministic-notes: kept when python -m bench.engine.deterministic rewrites this section -->",
         "<!-- /deterministic-notes -->")


def timed_run(job: dict, deterministic: bool) -> tuple[list[float], list[float]]:
    """(timed step seconds, every step's loss) of one fresh engine with `deterministic` set."""
    train = TrainConfig(steps=job["warmup"] + job["steps"], global_batch=job["micro_batch"],
                        micro_batch=job["micro_batch"], deterministic=deterministic)
    data = DataConfig(seq_len=job["seq_len"], min_len_fraction=1.0)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        engine = Engine(ModelConfig(**job["model"]), data, train, ParallelConfig(), rank=0, world_size=1)
        times, losses = [], []
        for step in range(train.steps):
            started = time.perf_counter()
            losses.append(engine.train_step().loss)
            if step >= job["warmup"]:
                times.append(time.perf_counter() - started)
        return times, losses
    finally:
        torch.use_deterministic_algorithms(before)
        gc.collect()


def measure(job: dict) -> dict:
    """Both settings over `job["rounds"]` rounds (module docstring): medians, ratio, loss equality."""
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[list[float]]] = {True: [], False: []}  # every round's, per setting
    for round_index in range(job["rounds"]):
        for setting in ((True, False) if round_index % 2 == 0 else (False, True)):
            step_times, run_losses = timed_run(job, setting)
            times[setting] += step_times
            losses[setting].append(run_losses)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    anchor = losses[True][0]
    return {"on_s": on, "off_s": off, "off_vs_on": off / on, "samples": len(times[True]),
            # Every round of each setting against the first "on" round: on must repeat itself, and off
            # is compared with it in each round, not only in the first.
            "on_repeats": all(run == anchor for run in losses[True]),
            "losses_equal": all(run == anchor for run in losses[False])}


def table(result: dict) -> str:
    return "\n".join([
        "| train.deterministic | median step | vs on (the default) | losses |",
        "|---|---|---|---|",
        f"| on | {result['on_s'] * 1e3:.1f} ms | 1.00x | "
        f"{'bitwise equal in every round' if result['on_repeats'] else 'differ between rounds'} |",
        f"| off | {result['off_s'] * 1e3:.1f} ms | {result['off_vs_on']:.2f}x | "
        f"{'bitwise equal to on in every round' if result['losses_equal'] else 'differ from on'} |",
    ])


def model_text(model: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in model.items())


def section(job: dict, result: dict, command: str) -> str:
    return (f"{SECTION}\n\nMeasured by `python -m bench.engine.deterministic` on {time.strftime('%Y-%m-%d')} "
            f"({platform.processor() or platform.machine()}, torch {torch.__version__}, one process, "
            f"{torch.get_num_threads()} threads). Command:\n\n    {command}\n\n"
            f"Model `{model_text(job['model'])}`, seq {job['seq_len']}, {job['micro_batch']} samples per step, fp32; "
            f"{job['rounds']} rounds of {job['warmup']} warm-up and {job['steps']} timed steps per setting "
            f"({result['samples']} timed steps each).\n\n{table(result)}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.deterministic", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=parse_model, default=parse_model(DEFAULT_MODEL))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=Path, help="rewrite this benchmark's section of this file (docs/benchmarks.md)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    job = {"model": args.model, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps,
           "warmup": args.warmup, "rounds": args.rounds}
    result = measure(job)
    print(table(result))
    if args.docs:
        command = shlex.join([".venv/bin/python", "-m", "bench.engine.deterministic", *argv])
        replace_section(args.docs, SECTION, section(job, result, command), NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
