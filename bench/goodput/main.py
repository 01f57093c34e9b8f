"""Goodput under the same random failures: undying vs Ray Train, one job, one seeded kill schedule, one table.

    .venv/bin/pip install -e '.[bench]'      # Ray Train's extras
    .venv/bin/python -m bench.goodput [--steps 1000] [--every 20] [--kills 3] [--mean-steps 150] [--first 50] [--seed 2]

The job is `examples/demo.yaml` (tiny GPT, 4 data-parallel ranks, DDP over gloo on CPU) with a
checkpoint every `--every` steps in both systems. The failures are random in training progress:
`--kills` SIGKILLs at steps a seeded Poisson process draws (`--mean-steps` apart on average, none
before step `--first`), each of a random world rank, after the backward of its step: undying's
`kill_rank` fault at `after_backward`, and the same hook in the Ray Train workers
(bench/goodput/worker.py). Each fires once per job, so both systems fail at the same points of
their training however long each took to start (kills due in job seconds would hit one system
while it still started). Both run on one private local Ray head started here
(bench/recovery/ray_head.py), so neither pays for starting Ray.

Numbers:
  wall                 the job's clock: undying's ledger wall; Ray Train, fit() start -> end
  effective training   undying's ledger `productive` bucket (training while it runs, the loop's
                       time between steps included); Ray Train, the engine's step seconds of the
                       steps that survive into the final model (its time between steps, a
                       checkpoint's `torch.save` and `report` among it, left out)
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


def kill_schedule(args, world_size: int) -> list[tuple[int, int]]:
    """(step, world rank) of each kill: a seeded Poisson process over the training's steps."""
    import random

    rng, step, kills = random.Random(args.seed), args.first, []
    for _ in range(args.kills):
        step += max(1, round(rng.expovariate(1.0 / args.mean_steps)))
        if step >= args.steps:
            break
        kills.append((step, rng.randrange(world_size)))
    return kills


def job_overrides(args, kills: list[tuple[int, int]]) -> list[str]:
    faults = ", ".join(f"{{kind: kill_rank, rank: {rank}, at_step: {step}, at_point: after_backward}}"
                       for step, rank in kills)
    return [f"chaos.faults=[{faults}]", f"train.steps={args.steps}", f"checkpoint.every_steps={args.every}",
            # Like with like against Ray Train, which has neither: each kill replaced by a new actor,
            # restored from storage (the figures in docs/benchmarks.md; --set overrides these).
            "elastic.spares=0", "checkpoint.memory.enabled=false",
            "elastic.max_restarts=100", *args.overrides]


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
    # The kills are at steps both reach; a count that differs is a kill that did not fire (a bug to read
    # the logs for) or one the rank's own restart fired twice.
    unequal = "" if u["failures"] == t["failures"] else (
        f"\n- NOT like for like: undying took {u['failures']} failure(s) and Ray Train {t['failures']}; "
        "read both logs.")
    # The like-for-like figures: the same steps and kills, timed on the job's clock. Goodput is each
    # system's own account (its effective training is not one measure: see the definitions).
    return (f"- the same {u['failures']} kills and steps: wall {u['wall_s']:.1f} s vs {t['wall_s']:.1f} s "
            f"({t['wall_s'] / max(u['wall_s'], 1e-9):.2f}x); time lost per failure "
            f"{u['lost_per_failure_s']:.2f} s vs {t['lost_per_failure_s']:.2f} s "
            f"({t['lost_per_failure_s'] / max(u['lost_per_failure_s'], 1e-9):.1f}x); steps redone "
            f"{u['steps_redone']} vs {t['steps_redone']}; final losses {same_loss}. Goodput by each system's own "
            f"account: {100 * u['goodput']:.1f}% vs {100 * t['goodput']:.1f}% (not one measure). One run each."
            + unequal)


def docs_section(result: dict) -> str:
    kills = ", ".join(f"rank {r} after the backward of step {s}" for s, r in result["kills"])
    return f"""{SECTION}

Measured by `python -m bench.goodput` on {result['date']} ({result['bench_s']:.0f} s for the whole bench). Command:

```bash
{result['command']}
```

Machine: {result['machine']}; 1-minute load average {result['load_1min']:.1f} at the start (what else ran, if
anything, is said in the notes).

Job: `examples/demo.yaml` with `{' '.join(result['overrides'])}`: 4 data-parallel ranks, tiny GPT on CPU,
a checkpoint every {result['every']} steps in both systems (undying: its async sharded writer; Ray Train:
`torch.save` of the whole state on rank 0 + `ray.train.report`). Random failures at seeded steps (a
Poisson process over the training's steps), each fired once, at the same point of training in both systems
(undying's `kill_rank` fault; the same hook in the Ray Train workers, bench/goodput/worker.py): {kills}.
One run each.

{result['table']}

{result['margin']}

Definitions: wall is the job's own clock (undying: its goodput ledger, from the controller's start; Ray
Train: `fit()` start to end; neither includes starting Ray, both include placing and starting the workers).
Effective training is undying's `productive` bucket (its loop's time between steps included), and for Ray
Train the engine's step seconds of the steps that survive into the final model (its time between steps,
a checkpoint's `torch.save` and `report` among it, left out): not the same measure, so the goodput row
compares each system's own account; wall and lost per failure are alike. Lost per failure is kill ->
first step completed after the restart, plus the compute of the redone steps, per failure.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="examples/demo.yaml")
    # 1000 steps keep undying training past the default schedule's last kill (about 46 s).
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every this many steps (both systems)")
    parser.add_argument("--kills", type=int, default=3, help="how many kills (fewer if the run ends first)")
    parser.add_argument("--mean-steps", type=float, default=150.0, help="mean steps between kills")
    parser.add_argument("--first", type=int, default=50, help="no kill before this step")
    parser.add_argument("--seed", type=int, default=2)
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
    spec_path = str((ROOT / args.spec).resolve())
    kills = kill_schedule(args, load_spec(spec_path).world_size)
    sets = job_overrides(args, kills)
    spec = load_spec(spec_path, sets)
    work = ROOT / "runs/bench/goodput-work" / time.strftime("%Y%m%d-%H%M%S")
    print(f"$ {command}\nkills (step, rank): {kills}\nwork in {work}", flush=True)
    load = os.getloadavg()[0]
    head = start_head(num_cpus=max(8, spec.world_size + 1))
    try:
        runs = [run_undying(spec_path, sets, work / "undying", head.address)]
        print(f"undying: {runs[-1]}", flush=True)
        # Ray Train gets the chaos section too (its engine ignores it) so both build the identical spec;
        # its workers fire the same kills themselves (worker.kill_hook).
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
