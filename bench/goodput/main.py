"""Goodput under the same random failures: undying vs Ray Train, one job, one seeded kill schedule, one table.

    .venv/bin/pip install -e '.[bench]'      # Ray Train's extras
    .venv/bin/python -m bench.goodput [--steps 1000] [--every 20] [--mtbf 60s] [--seed 2] [--start 25s] [--max-faults 3]

The job is `examples/demo.yaml` (tiny GPT, 4 data-parallel ranks, DDP over gloo on CPU) with a
checkpoint every `--every` steps in both systems. The failures are undying's random
`kill_rank` process (chaos.mtbf_s per rank, seeded; chaos.schedule.expand): kill i SIGKILLs
world rank r_i at t_i seconds of the job's clock. undying's controller fires them itself
(its clock: the goodput ledger, from the controller's start); the Ray Train workers
(bench/goodput/worker.py) fire the same list against the clock of `fit()`'s start. Both
run on one private local Ray head started here (bench/recovery/ray_head.py), so neither pays
for starting Ray.

Numbers, the same definition for both systems:
  wall                 the job's clock: undying's ledger wall; Ray Train, fit() start -> end
  effective training   productive seconds: undying's ledger `productive` bucket; Ray Train,
                       the engine's step seconds of the steps that survive into the final model
  lost per failure     kill -> first step completed after the restart, plus the compute of the
                       steps redone, per failure
  steps redone         step computations beyond one per step of the final model
  goodput              effective training / wall
It prints the table, writes runs/bench/goodput.json and rewrites its section of docs/benchmarks.md.
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

from bench.docs import replace_section
from bench.recovery.ray_head import ROOT, VENV_BIN, start_head, worker_env
from bench.recovery.systems import launch, read_events

SECTION = "## Goodput under random failures: undying vs Ray Train"
NOTES = ("<!-- goodput-notes: kept when python -m bench.goodput rewrites this section -->", "<!-- /goodput-notes -->")
WORKER = "bench.goodput.worker"  # run as `python -m` from the repository root


def job_overrides(args) -> list[str]:
    return ["chaos.faults=[]", f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}",
            f"chaos.mtbf_s={args.mtbf}", "chaos.mtbf_kind=kill_rank", f"chaos.seed={args.seed}",
            f"chaos.mtbf_start_s={args.start}", f"chaos.mtbf_max_faults={args.max_faults}",
            # Like with like against Ray Train, which has neither: each kill replaced by a new actor,
            # restored from storage (the figures in docs/benchmarks.md; --set overrides these).
            "elastic.spares=0", "checkpoint.memory.enabled=false",
            "elastic.max_restarts=100", *args.overrides]


def kill_schedule(spec) -> list[tuple[float, int]]:
    """(job seconds, rank) of every kill undying's controller will fire for this spec."""
    from chaos.schedule import expand
    from orchestrator.controller.fault_clock import CHAOS_HORIZON_S

    events = expand(spec.chaos, horizon_s=CHAOS_HORIZON_S, ranks=spec.world_size)
    return [(e.at_seconds, e.rank) for e in events if e.at_seconds is not None]


def run_undying(spec_path: str, sets: list[str], workdir: Path, address: str) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    report_path = workdir / "report.json"
    cmd = [str(VENV_BIN / "undying"), "run", spec_path, "--address", address, "--report", str(report_path)]
    cmd += [a for s in [*sets, f"checkpoint.url=file://{workdir / 'ckpt'}"] for a in ("--set", s)]
    command_wall = launch(cmd, workdir / "undying.log", worker_env())
    report = json.loads(report_path.read_text())
    failures = report["failures"]
    to_first_step = [f["first_step_after_s"] for f in failures if f["first_step_after_s"] is not None]
    n = max(1, len(failures))
    goodput = report["goodput"]
    return {"system": "undying", "wall_s": goodput["wall_s"], "productive_s": goodput["productive_s"],
            "failures": len(failures), "steps_redone": report["redone_steps"],
            "lost_per_failure_s": (statistics.mean(to_first_step) if to_first_step else 0.0) + report["redone_s"] / n,
            "goodput": report["goodput"]["ratio"], "final_loss": report["final_loss"], "command_wall_s": command_wall,
            "badput_s": report["goodput"]["badput_s"], "log": str(workdir / "undying.log")}


def raytrain_numbers(events: list[dict]) -> dict:
    """The table's numbers from the Ray Train run's events (see module doc)."""
    t0 = next(e["t0"] for e in events if e["ev"] == "fit_start")
    end = next(e["t"] for e in events if e["ev"] == "fit_end")
    steps = sorted((e for e in events if e["ev"] == "step"), key=lambda e: e["t"])
    last = {e["step"]: e for e in steps}  # the computation of each step that survives (the latest)
    redone = [e for e in steps if last[e["step"]] is not e]
    restores = sorted(e["t"] for e in events if e["ev"] == "restored")
    kills = sorted(e["t"] for e in events if e["ev"] == "kill")
    recovered = []
    for kill in kills:
        restored = next((t for t in restores if t > kill), None)
        first = next((e["t"] for e in steps if restored is not None and e["t"] > restored), None)
        if first is not None:
            recovered.append(first - kill)
    productive = sum(e["step_s"] for e in last.values())
    n = max(1, len(kills))
    return {"system": "Ray Train", "wall_s": end - t0, "productive_s": productive, "failures": len(kills),
            "steps_redone": len(redone),
            "lost_per_failure_s": (statistics.mean(recovered) if recovered else 0.0)
            + sum(e["step_s"] for e in redone) / n,
            "goodput": productive / (end - t0), "final_loss": last[max(last)]["loss"]}


def run_raytrain(spec_path: str, sets: list[str], kills: list, workdir: Path, address: str, every: int,
                 world_size: int) -> dict:
    (workdir / "ckpt").mkdir(parents=True, exist_ok=True)
    cfg = {"spec": spec_path, "overrides": sets, "events": str(workdir / "events.jsonl"), "kills": kills,
           "markers": str(workdir / "markers"), "ckpt_dir": str(workdir / "ckpt"), "every": every,
           "address": address, "world_size": world_size, "run_name": f"goodput-{workdir.name}", "max_restarts": 100}
    command_wall = launch([sys.executable, "-m", WORKER, "--config", json.dumps(cfg)], workdir / "raytrain.log",
                          worker_env())
    return {**raytrain_numbers(read_events(Path(cfg["events"]))), "command_wall_s": command_wall,
            "log": str(workdir / "raytrain.log")}


def table(runs: list[dict]) -> str:
    rows = ["| system | wall (job clock) | effective training | failures | lost per failure | steps redone "
            "| goodput | final loss |", "|---" * 8 + "|"]
    for r in runs:
        rows.append(f"| {r['system']} | {r['wall_s']:.1f} s | {r['productive_s']:.1f} s | {r['failures']} "
                    f"| {r['lost_per_failure_s']:.2f} s | {r['steps_redone']} | {100 * r['goodput']:.1f}% "
                    f"| {r['final_loss']:.6f} |")
    return "\n".join(rows)


def margin(runs: list[dict]) -> str:
    by = {r["system"]: r for r in runs}
    u, t = by.get("undying"), by.get("Ray Train")
    if not u or not t:
        return ""
    same_loss = "equal" if u["final_loss"] == t["final_loss"] else "DIFFERENT"
    # The kills are at fixed job seconds; a system that finishes first escapes the later ones.
    unequal = "" if u["failures"] == t["failures"] else (
        f"\n- NOT like for like: undying took {u['failures']} failure(s) and Ray Train {t['failures']}; "
        "raise --steps so that both jobs outlive the last kill.")
    return (f"- goodput: undying {100 * u['goodput']:.1f}% vs Ray Train {100 * t['goodput']:.1f}% "
            f"({100 * (u['goodput'] - t['goodput']):+.1f} points); time lost per failure "
            f"{u['lost_per_failure_s']:.2f} s vs {t['lost_per_failure_s']:.2f} s "
            f"({t['lost_per_failure_s'] / max(u['lost_per_failure_s'], 1e-9):.1f}x); final losses {same_loss}."
            + unequal)


def docs_section(result: dict) -> str:
    kills = ", ".join(f"rank {r} at {t:.1f} s" for t, r in result["kills"])
    return f"""{SECTION}

Measured by `python -m bench.goodput` on {result['date']} ({result['bench_s']:.0f} s for the whole bench). Command:

```bash
{result['command']}
```

Machine: {result['machine']}; shared while it ran (1-minute load average {result['load_1min']:.1f} at the start).

Job: `examples/demo.yaml` with `{' '.join(result['overrides'])}`: 4 data-parallel ranks, tiny GPT on CPU,
a checkpoint every {result['every']} steps in both systems (undying: its async sharded writer; Ray Train:
`torch.save` of the whole state on rank 0 + `ray.train.report`). Random failures: `chaos.mtbf_s`
per rank, seeded; the kill schedule (job seconds) is {kills}. undying's controller fires it; the Ray Train
workers fire the same list against the clock of `fit()`'s start (bench/goodput/worker.py). One run each.

{result['table']}

{result['margin']}

Definitions (the same for both systems): wall is the job's own clock (undying: its goodput ledger,
from the controller's start; Ray Train: `fit()` start to end; neither includes starting Ray, both include
placing and starting the workers). Effective training is undying's `productive` bucket, and for Ray Train
the engine's step seconds of the steps that survive into the final model. Lost per failure is kill ->
first step completed after the restart, plus the compute of the redone steps, per failure.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="examples/demo.yaml")
    # 1000 steps keep undying training past the default schedule's last kill (about 46 s).
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every this many steps (both systems)")
    parser.add_argument("--mtbf", default="60s", help="chaos.mtbf_s per rank")
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--start", default="25s", help="no kill before this many job seconds")
    parser.add_argument("--max-faults", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default="runs/bench/goodput.json")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    parser.add_argument("--from-json", action="store_true", help="rewrite the docs from --out; run nothing")
    parser.add_argument("--sweep", metavar="JSON", help="also write the section of an `undying chaos sweep --out` JSON")
    parser.add_argument("--sweep-command", default="", help="the sweep's command line, for its section")
    parser.add_argument("--sweep-plot", help="the sweep's PNG, relative to the docs file")
    parser.add_argument("--sweep-minutes", type=float, help="how long the sweep took")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.from_json:
        write_docs(args, json.loads((ROOT / args.out).read_text()))
        return 0
    from bench.recovery.main import machine
    from orchestrator.spec.job_spec import load_spec

    command = shlex.join([".venv/bin/python", "-m", "bench.goodput", *(argv if argv is not None else sys.argv[1:])])
    started = time.time()
    sets = job_overrides(args)
    spec_path = str((ROOT / args.spec).resolve())
    spec = load_spec(spec_path, sets)
    kills = kill_schedule(spec)
    work = ROOT / "runs/bench/goodput-work" / time.strftime("%Y%m%d-%H%M%S")
    print(f"$ {command}\nkills (job s, rank): {[(round(t, 1), r) for t, r in kills]}\nwork in {work}", flush=True)
    load = os.getloadavg()[0]
    head = start_head(num_cpus=max(8, spec.world_size + 1))
    try:
        runs = [run_undying(spec_path, sets, work / "undying", head.address)]
        print(f"undying: {runs[-1]}", flush=True)
        # Ray Train gets the chaos section too (its engine ignores it) so both build the identical spec.
        runs.append(run_raytrain(spec_path, sets, kills, work / "raytrain", head.address, args.every, spec.world_size))
        print(f"Ray Train: {runs[-1]}", flush=True)
    finally:
        head.stop()
    result = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "load_1min": load,
              "overrides": sets, "every": args.every, "kills": kills, "runs": runs, "table": table(runs),
              "margin": margin(runs), "bench_s": time.time() - started}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("\n" + result["table"] + "\n\n" + result["margin"] + f"\n\nresults: {out}", flush=True)
    write_docs(args, result)
    return 0


def write_docs(args, result: dict) -> None:
    if not args.docs:
        return
    replace_section(ROOT / args.docs, SECTION, docs_section(result), NOTES)
    print(f"section {SECTION[3:]!r} written to {args.docs}")
    if args.sweep:
        from bench.goodput import sweep

        data = json.loads(Path(args.sweep).read_text())
        minutes = args.sweep_minutes * 60 if args.sweep_minutes else None
        text = sweep.sweep_section(data, args.sweep_command, args.sweep_plot, result["date"], minutes)
        replace_section(ROOT / args.docs, sweep.SECTION, text, sweep.NOTES)
        print(f"section {sweep.SECTION[3:]!r} written to {args.docs}")
