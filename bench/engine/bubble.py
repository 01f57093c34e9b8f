"""Pipeline bubble against the schedule's formula: GPipe and 1F1B on wide stages.

    .venv/bin/python -m bench.engine.bubble [--cases 2x4x1024 2x8x1024 4x8x512] [--steps 5]
                                            [--json PATH] [--docs docs/benchmarks.md]

A case `PxMxD` runs P local processes (gloo, one thread each: tests.dist._launch.run_ranks),
one pipeline stage of two transformer blocks of width D each, and trains `--steps` steps of M
microbatches (4 fixed-length samples of 64 tokens) under GPipe, then under 1F1B. Wide stages
and a small vocabulary keep each microbatch's compute (tens of ms) well above the activation
sends and Python, which the formula does not count. Per schedule it reports:
  * measured: the ranks' mean `PipelineTrace.idle_fraction` per step, then the median over the
    steps (the first, which sets up the communicators, left out; a step another process slowed
    is an outlier the median drops);
  * formula: GPipe's and 1F1B's (p - 1) / (m + p - 1), and measured / formula;
  * with instant transfers: the step replayed from its trace with free transfers
    (`instant_transfer_bubble`), which splits the gap to the formula into stage imbalance and
    communication;
  * in flight: the most activations any rank held (GPipe: m; 1F1B: at most p).
The check is measured within 20 % of the formula; the exit code is 1 when a case misses it.
Cores shared with other processes widen the measured bubble: a stage whose peer lost its core
waits longer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.docs import write_section

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Pipeline bubble against the formula"
NOTES = ("<!-- bubble-notes: kept when python -m bench.engine.bubble rewrites this section -->",
         "<!-- /bubble-notes -->")
SCHEDULES = ("gpipe", "1f1b")
TOLERANCE = 0.2


def measure_schedules(rank: int, world_size: int, d_model: int, n_micro: int, steps: int) -> dict:
    """Runs on every rank (run_ranks): per schedule, per step, (idle fraction, activations in flight,
    the trace's events)."""
    import torch.distributed as dist

    from trainer.config import DataConfig, ModelConfig
    from trainer.data import DataCursor
    from trainer.pipeline import PipelineRunner
    from trainer.stages import build_stage, split_layers

    model = ModelConfig(vocab_size=64, n_layers=2 * world_size, n_heads=4, d_model=d_model, max_seq_len=64)
    data = DataConfig(seq_len=64, min_len_fraction=1.0)
    chunk = split_layers(model, data.seq_len, world_size)[rank]
    stage = build_stage(model, 0, chunk)
    cursor = DataCursor(data, model.vocab_size)
    measured = {}
    for schedule in SCHEDULES:
        runner = PipelineRunner(model, [chunk], [stage], schedule=schedule, pp=dist.group.WORLD, n_micro=n_micro,
                                micro_batch=4, seq_len=data.seq_len)
        measured[schedule] = []
        for step in range(steps):
            batches = cursor.microbatches(step, 4 * n_micro, 4, 0, 1)
            trace = runner.step(batches, sum(b.n_tokens for b in batches)).trace
            stage.zero_grad(set_to_none=True)
            measured[schedule].append((trace.idle_fraction(), trace.max_in_flight(), trace.events))
    return measured


def median_bubble(ranks: list[dict], schedule: str) -> float:
    """Median over steps (the first left out) of the ranks' mean idle fraction."""
    steps = len(ranks[0][schedule])
    return statistics.median(statistics.fmean(r[schedule][s][0] for r in ranks) for s in range(1, steps))


def median_instant_bubble(ranks: list[dict], schedule: str) -> float:
    """`instant_transfer_bubble` of each step (the first left out), the median over steps."""
    steps = len(ranks[0][schedule])
    return statistics.median(instant_transfer_bubble([r[schedule][s][2] for r in ranks]) for s in range(1, steps))


def instant_transfer_bubble(ranks_events: list[list]) -> float:
    """The ranks' mean idle fraction had every transfer been instant and nothing run between actions.

    Replays one step: each rank runs its own actions (F, L, B: `ActionEvent`s) in the order it ran
    them and for as long as they took, each as soon as its rank is free and its input exists (a
    forward needs the previous chunk's forward of that microbatch, a backward the next chunk's
    backward, the last chunk's its own forward and loss, which its rank ran before). What the
    measured bubble holds beyond this is transfers and the time between actions; what this holds
    beyond the formula is stages of unequal speed."""
    done: dict[tuple[str, int, int], float] = {}
    last_chunk = max(e.chunk for events in ranks_events for e in events)
    queues = [sorted(events, key=lambda e: e.start) for events in ranks_events]
    free = [0.0] * len(queues)
    position = [0] * len(queues)
    while any(position[r] < len(q) for r, q in enumerate(queues)):
        progressed = False
        for r, queue in enumerate(queues):
            while position[r] < len(queue):
                event = queue[position[r]]
                need = _input_of(event, last_chunk)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need is not None else 0.0)
                free[r] = done[(event.kind, event.chunk, event.micro)] = start + (event.end - event.start)
                position[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the traced actions wait on each other: not one step of a pipeline schedule")
    window = max(free)
    busy = [sum(e.end - e.start for e in events) for events in ranks_events]
    return statistics.fmean(1.0 - b / window for b in busy) if window > 0 else 0.0


def _input_of(event, last_chunk: int) -> tuple[str, int, int] | None:
    """The action whose output `event` consumes from another chunk (None: from its own rank only).
    Schedules of F, L and B only: a split backward's I and W have other inputs, not modelled."""
    if event.kind not in ("F", "L", "B"):
        raise ValueError(f"action {event.kind!r}: the replay models F, L and B (GPipe, 1F1B), not split backwards")
    if event.kind == "F" and event.chunk > 0:
        return ("F", event.chunk - 1, event.micro)
    if event.kind == "B" and event.chunk < last_chunk:
        return ("B", event.chunk + 1, event.micro)
    return None


def formula(p: int, m: int) -> float:
    """The fill-and-drain idle fraction of GPipe and of 1F1B (same bubble, fewer activations)."""
    return (p - 1) / (m + p - 1)


def parse_case(text: str) -> tuple[int, int, int]:
    try:
        p, m, d = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: write it as PxMxD, e.g. 2x8x1024") from None
    if p < 2 or m < 1 or d % 4:
        raise argparse.ArgumentTypeError(f"case {text!r}: needs P >= 2 stages, M >= 1 microbatches, D divisible by 4")
    return p, m, d


def rows_of(case: tuple[int, int, int], ranks: list[dict]) -> list[dict]:
    p, m, d = case
    expected = formula(p, m)
    out = []
    for schedule in SCHEDULES:
        measured = median_bubble(ranks, schedule)
        in_flight = max(n for r in ranks for _, n, _ in r[schedule])
        out.append({"case": f"p{p} m{m} d{d}", "schedule": schedule, "measured": measured, "formula": expected,
                    "ratio": measured / expected, "instant": median_instant_bubble(ranks, schedule),
                    "in_flight": in_flight,
                    "in_flight_bound": m if schedule == "gpipe" else p,
                    "ok": abs(measured / expected - 1) <= TOLERANCE})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| case | schedule | measured bubble | formula (p-1)/(m+p-1) | measured / formula | "
             f"within {TOLERANCE:.0%} | with instant transfers | most in flight (bound) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['schedule']} | {row['measured']:.1%} | {row['formula']:.1%} | "
                     f"{row['ratio']:.2f} | {'yes' if row['ok'] else 'NO'} | {row['instant']:.1%} | "
                     f"{row['in_flight']} ({row['in_flight_bound']}) |")
    return "\n".join(lines)


def docs_section(result: dict) -> str:
    loads = result["load_averages"]
    return f"""{SECTION}

Measured by `python -m bench.engine.bubble` on {result['date']}. Command:

```bash
{result['command']}
```

{os.cpu_count()} cores, gloo, one thread per rank, {result['steps']} steps per schedule (the first left out).
The 1-minute load average was {min(loads):.1f} to {max(loads):.1f} (sampled before each case and at the end).

{result['table']}

- measured bubble: per step the ranks' mean `PipelineTrace.idle_fraction` (1 - busy / window), then the median
  over steps. It counts every wait, so activation sends and a peer slowed by a shared core add to it.
- with instant transfers: the same step replayed from its trace (each rank's actions in its order and for
  their measured durations, each started as soon as its input exists): the bubble of the schedule and this
  run's action times alone. Away from the formula: stages of unequal speed, and durations stretched or
  shrunk by ranks sharing cores; between it and the measured bubble: the transfers and the time between
  actions.
- most in flight: the most activations any rank held at once; GPipe holds every microbatch, 1F1B at most p.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.bubble", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=[(2, 4, 1024), (2, 8, 1024), (4, 8, 512)],
                        metavar="PxMxD", help="stages x microbatches x width (default 2x4x1024 2x8x1024 4x8x512)")
    parser.add_argument("--steps", type=int, default=5, help="steps per schedule, the first left out (>= 2)")
    parser.add_argument("--json", default="runs/bench/bubble.json", help="results file ('' to skip)")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is left out)")
    from tests.dist._launch import run_ranks

    os.chdir(ROOT)
    given = argv if argv is not None else sys.argv[1:]
    command = shlex.join([".venv/bin/python", "-m", "bench.engine.bubble", *given])
    rows, loads = [], []
    for case in args.cases:
        loads.append(os.getloadavg()[0])
        started = time.perf_counter()
        ranks = run_ranks(measure_schedules, case[0], (case[2], case[1], args.steps), timeout_s=900)
        rows += rows_of(case, ranks)
        print(f"case {case}: {time.perf_counter() - started:.0f} s", flush=True)
    loads.append(os.getloadavg()[0])
    result = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.steps,
              "load_averages": loads, "rows": rows, "table": table(rows)}
    print("\n" + result["table"])
    if args.json:
        out = ROOT / args.json
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    if args.docs:
        write_section(ROOT / args.docs, SECTION, docs_section(result), NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
