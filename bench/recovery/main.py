"""Recovery speed of undying vs Ray Train vs torchrun: the same job, the same kill, one run, one table.

    .venv/bin/pip install -e '.[bench]'      # Ray Train's extras (pandas, pyarrow, ...)
    .venv/bin/python -m bench.recovery [--repeats N] [--set KEY=VALUE ...] [--undying-set KEY=VALUE ...]

The job is `examples/demo.yaml` (tiny GPT, 4 data-parallel ranks, DDP over gloo on CPU, a
checkpoint every 10 steps, 60 steps) and its chaos fault: rank 1 SIGKILLs itself after the
backward of step 25. Each system runs it with the same engine (trainer.engine.Engine) and
the same kill:
  undying    `undying run examples/demo.yaml --report ...` (it injects the fault itself), plain,
             with a warm spare, shrinking, and two-level (a warm spare and the memory level);
  Ray Train  TorchTrainer + FailureConfig, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.5, checkpoints
             through ray.train.report; the worker kills itself on the first attempt only;
  torchrun   --max-restarts 3, c10d rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
             torch.save checkpoints; rank 1 kills itself on the first attempt only.
undying and Ray Train share one private local Ray head started here (so neither pays for
starting Ray); a failure-free torchrun run gives the reference final loss.

For every run it measures, from timestamps the processes write themselves: detection
(kill -> the system's first reaction), kill-to-first-step (kill -> first step completed
after the restart), steps redone, total wall time, and whether the final loss equals the
failure-free one. It prints a table (median [min-max] over --repeats) with ratios against
undying, writes runs/bench/recovery.json and rewrites its own section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.recovery.ray_head import ROOT, RayHead, start_head
from bench.recovery.systems import run_raytrain, run_torchrun, run_undying

# --systems key -> (table name, extra undying overrides). The recovery targets are for undying
# with a warm spare (or a shrink); the plain run (no spare: elastic.spares=0, not the default
# auto) replaces the dead rank with a new actor. The shrink variant gets no replacement (dp 4 -> 2
# at once) and does not grow back: its layout changes, so its final loss is compared within
# SHRINK_RTOL instead of bit for bit. The two-level variant adds the memory level (snapshots in
# host memory, copied to a buddy rank) to the warm spare; its cadence, MEMORY_EVERY steps, is
# justified in docs/benchmarks.md (the recovery notes).
MEMORY_EVERY = 4
# The first three rows are storage only (the memory level is on by default, so they switch it off).
STORAGE_ONLY = "checkpoint.memory.enabled=false"
SYSTEMS = {"undying": ("undying", ["elastic.spares=0", STORAGE_ONLY]),
           "undying-spare": ("undying (warm spare)", ["elastic.spares=1", STORAGE_ONLY]),
           "undying-shrink": ("undying (shrink)", ["elastic.spares=0", "elastic.replace_timeout_s=0",
                                                   "elastic.grow=false", STORAGE_ONLY]),
           "undying-memory": ("undying (two-level)", ["elastic.spares=1", "checkpoint.memory.enabled=true",
                                                      f"checkpoint.memory.every_steps={MEMORY_EVERY}"]),
           "raytrain": ("Ray Train", None), "torchrun": ("torchrun", None)}
SHRINK_RTOL = 1e-5
TARGETS = {"Ray Train": 15.0, "torchrun": 7.0}  # kill-to-first-step at least this many x faster
# Rows with the memory level: kill-to-first-step at most this, and steps redone at most one memory interval.
MEMORY_TARGET_S = 0.5
SECTION = "## Recovery: undying vs Ray Train vs torchrun"
NOTES = ("<!-- recovery-notes: kept when python -m bench.recovery rewrites this section -->",
         "<!-- /recovery-notes -->")


def job_from_spec(spec_path: str, overrides: list[str]) -> dict:
    """What every system needs to know about the job, taken from undying's own spec."""
    from orchestrator.spec.job_spec import load_spec

    spec = load_spec(spec_path, overrides)
    kills = [f for f in spec.chaos.faults if f.kind == "kill_rank" and f.at_step is not None]
    if len(spec.chaos.faults) != 1 or not kills:
        raise SystemExit(f"{spec_path}: needs exactly one chaos fault, a kill_rank with at_step")
    if spec.checkpoint.every_steps is None:
        raise SystemExit(f"{spec_path}: needs checkpoint.every_steps (a fixed interval) to compare systems")
    return {"spec": str(Path(spec_path).resolve()), "overrides": overrides, "world_size": spec.world_size,
            "kill_rank": kills[0].rank, "kill_step": kills[0].at_step, "every": spec.checkpoint.every_steps,
            "steps": spec.train.steps, "name": spec.name}


def machine() -> str:
    import ray
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0)
    return (f"{os.cpu_count()} cores ({cpu}), {mem_kb / 2**20:.0f} GiB RAM, no GPU; "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, ray {ray.__version__}")


def summarise(runs: list[dict], reference_loss: float | None) -> dict:
    """Median and range of each number over the repeats of one system."""
    def stats(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    keys = ("detection_s", "kill_to_first_step_s", "steps_redone", "wall_s")
    out = {key: stats([r[key] for r in runs]) for key in keys}
    out["phases"] = {name: statistics.median(r["phases"][name] for r in runs) for name in runs[0]["phases"]}
    losses = [r["final_loss"] for r in runs]
    out["final_losses"] = losses
    rtol = SHRINK_RTOL if runs[0]["system"] == SYSTEMS["undying-shrink"][0] else 0.0
    out["loss_matches_reference"] = None if reference_loss is None else all(
        abs(x - reference_loss) <= rtol * abs(reference_loss) for x in losses)
    out["loss_rtol"] = rtol
    if "restore_level" in runs[0]:  # undying: the level each recovery restored from, and what it read
        out["restore_levels"] = [r["restore_level"] for r in runs]
        out["storage_read_bytes"] = stats([r["storage_read_bytes"] or 0 for r in runs])
        out["memory_every"] = runs[0]["memory_every"]
        out["median_step_s"] = statistics.median(r["median_step_s"] for r in runs)
    return out


def _level_cells(s: dict) -> str:
    """The restore level(s) and the storage bytes the restore read; dashes for systems other than undying."""
    if "restore_levels" not in s:
        return "- | - | "
    levels = s["restore_levels"]
    level = " ".join(f"{name} {levels.count(name)}/{len(levels)}" for name in sorted(set(levels), key=str))
    mb = {key: value / 1e6 for key, value in s["storage_read_bytes"].items()}
    return f"{level if len(set(levels)) > 1 else levels[0]} | {_cell(mb, 'MB', 2)} | "


def memory_targets(summary: dict) -> list[str]:
    """The memory level's targets for each row that has it: kill-to-first-step and lost work."""
    lines = []
    for name, s in summary.items():
        every = s.get("memory_every")
        if not every:
            continue
        k2f, redone = s["kill_to_first_step_s"]["median"], s["steps_redone"]["max"]
        lines.append(f"- {name} kill-to-first-step = {k2f:.2f} s (target at most {MEMORY_TARGET_S} s: "
                     f"{'met' if k2f <= MEMORY_TARGET_S else 'NOT met'}); steps redone at most {redone:.0f} "
                     f"against a memory interval of {every} steps = {every * s['median_step_s']:.2f} s (target "
                     f"at most one interval: {'met' if redone <= every else 'NOT met'})")
    return lines


def _cell(s: dict, unit: str = "s", digits: int = 2) -> str:
    fmt = f"{{:.{digits}f}}"
    text = fmt.format(s["median"]) + (f" {unit}" if unit else "")
    low, high = fmt.format(s["min"]), fmt.format(s["max"])
    return text if low == high else f"{text} [{low}-{high}]"


def tables(summary: dict, reference_loss: float | None) -> str:
    """The result table with ratios against each undying variant, the target lines and the phase split."""
    anchors = [name for name in summary if name.startswith("undying")]
    rows = ["| system | detection | kill-to-first-step | " + "".join(f"/ {a} | " for a in anchors)
            + "steps redone | restored from | storage read | total wall | final loss |",
            "|---" * (8 + len(anchors)) + "|"]
    for name, s in summary.items():
        ratios = "".join(f"{_ratio(s, summary[a]):.1f}x | " for a in anchors)
        same = "= failure-free" if not s.get("loss_rtol") else f"= failure-free within {s['loss_rtol']:g}"
        match = {None: "not checked", True: same, False: "DIFFERS"}[s["loss_matches_reference"]]
        rows.append(f"| {name} | {_cell(s['detection_s'], digits=3)} | {_cell(s['kill_to_first_step_s'])} | {ratios}"
                    f"{_cell(s['steps_redone'], '', 0)} | {_level_cells(s)}{_cell(s['wall_s'], digits=1)} "
                    f"| {s['final_losses'][0]:.6f} {match} |")
    lines = rows + [""]
    for name, target in TARGETS.items():
        for anchor in anchors:
            if name in summary:
                ratio = _ratio(summary[name], summary[anchor])
                verdict = "met" if ratio >= target else "NOT met"
                # Like with like only against plain undying: a spare or snapshots are undying's options,
                # and the anchor runs its own default (a fresh worker, a storage checkpoint).
                unlike = "" if anchor == "undying" else f"; undying's option against {name}'s default"
                lines.append(f"- {name} / {anchor} kill-to-first-step = {ratio:.1f}x (target {target:.0f}x: "
                             f"{verdict}{unlike})")
    lines += memory_targets(summary)
    if reference_loss is not None:
        lines.append(f"- failure-free reference final loss (torchrun, no kill): {reference_loss:.6f}")
    names = list(next(iter(summary.values()))["phases"])
    lines += ["", "Where kill-to-first-step goes (medians, seconds):", "",
              "| system | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for name, s in summary.items():
        lines.append(f"| {name} | " + " | ".join(f"{s['phases'][p]:.2f}" for p in names) + " |")
    return "\n".join(lines)


def _ratio(s: dict, anchor: dict) -> float:
    return s["kill_to_first_step_s"]["median"] / anchor["kill_to_first_step_s"]["median"]


def _accounts(result: dict) -> str:
    """Each undying variant's largest phase and its own transition lines for the median run; Ray Train's
    restart timing from its controller log."""
    verdicts, accounts = [], []
    for name, runs in result["runs"].items():
        if not name.startswith("undying") or not runs:
            continue
        summary = result["summary"][name]
        phases = summary["phases"]
        worst = max(phases, key=phases.get)
        verdicts.append(f"- {name}: kill-to-first-step {summary['kill_to_first_step_s']['median']:.2f} s, "
                        f"the largest phase is {worst} ({phases[worst]:.2f} s).")
        median_run = sorted(runs, key=lambda r: r["kill_to_first_step_s"])[len(runs) // 2]
        accounts.append(f"{name}, its own account of the median run (controller job seconds):\n\n```\n"
                        + "\n".join(median_run["transitions"]) + "\n```")
    text = "Where undying's time goes:\n\n" + "\n".join(verdicts) + "\n\n" + "\n\n".join(accounts) + "\n"
    raytrain = result["runs"].get("Ray Train")
    if raytrain:
        median_run = sorted(raytrain, key=lambda r: r["kill_to_first_step_s"])[len(raytrain) // 2]
        steps = "; ".join(f"{what} in {seconds:.2f} s"
                          for what, seconds in median_run["restart_log"] if seconds >= 0.05)
        text += f"\nRay Train's re-form, from its controller log (median run): {steps}.\n"
    return text


def docs_section(result: dict) -> str:
    job = result["job"]
    loads = [r["load_1min"] for runs in result["runs"].values() for r in runs]
    return f"""{SECTION}

Measured by `python -m bench.recovery` on {result['date']}. Command:

```bash
{result['command']}
```

Machine: {result['machine']}. 1-minute load average {min(loads):.1f} to {max(loads):.1f} at the start of the
runs, on {os.cpu_count()} cores (what else ran, if anything, is said in the notes).

Job: `{Path(job['spec']).relative_to(ROOT)}` ({job['world_size']} data-parallel ranks, tiny GPT, DDP over gloo on
CPU, checkpoint every {job['every']} steps, {job['steps']} steps); rank {job['kill_rank']} is SIGKILLed after the
backward of step {job['kill_step']}. Every system trains with `trainer.engine.Engine`; undying and Ray Train
run on the same local Ray head. Medians over {result['repeats']} run(s) per system, [min-max] when they differ;
in the phase table each column is its own median, so a row need not add up to the total.

{result['table']}

How each number is taken (every timestamp is `time.time()` on this machine, written by the processes):
- kill: the killed rank's own timestamp just before it sends itself SIGKILL.
- detection: undying, the controller noticing (its report's `detected_after_s`); Ray Train, the
  controller's `[FailurePolicy] RETRY` log line (health check every 0.5 s); torchrun, the agent's first
  reaction in its log (SIGTERM to the survivors, or "will restart worker group"; it polls every 0.1 s).
- re-form: detection -> the restarted training function is running in a formed process group
  (undying: RENDEZVOUS -> RESTORING). restore: -> engine built and checkpoint loaded (undying:
  RESTORING -> RUNNING). first step: -> rank 0 completes the first step after the restart.
- steps redone: steps completed before the kill minus the step the restart resumed from.
- restored from, storage read: undying's run report (`failures[0].restore_level`, and
  `storage_read_bytes`, the bytes the restore read from durable storage, all ranks). The two-level
  row adds to the warm spare `checkpoint.memory: {{enabled: true, every_steps: {MEMORY_EVERY}}}`: each rank
  snapshots into host memory and copies it to a buddy rank; a restore uses the newest complete
  snapshot when it is at least as new as the newest storage checkpoint and every shard has a live holder.
- total wall: launch to exit of the system's command (Ray's start is not included for undying and Ray Train).

{_accounts(result)}"""


def write_docs(path: Path, section: str) -> None:
    """Replace only this benchmark's section (up to the next `## ` heading); others' sections stay.

    Hand-written notes between the NOTES markers inside the old section are carried over."""
    header = "# Benchmarks\n\nMeasured figures; each section says how to reproduce it.\n"
    text = path.read_text() if path.exists() else header
    start = text.find(SECTION)
    end = text.find("\n## ", start + len(SECTION)) if start >= 0 else -1
    old = text[start:end if end >= 0 else len(text)] if start >= 0 else ""
    if NOTES[0] in old and NOTES[1] in old:
        section = section.rstrip("\n") + "\n\n" + old[old.index(NOTES[0]):old.index(NOTES[1]) + len(NOTES[1])] + "\n"
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        rest = text[end + 1:] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per system (median and range reported)")
    parser.add_argument("--spec", default="examples/demo.yaml", help="undying job spec; its chaos kill is the kill")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="spec override for every system, e.g. --set train.steps=40")
    parser.add_argument("--undying-set", action="append", default=[], metavar="KEY=VALUE",
                        help="spec override for the undying runs only, e.g. --undying-set elastic.min_dp=2")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                        help="which to run (default: all, in this order)")
    parser.add_argument("--out", default="runs/bench/recovery.json")
    parser.add_argument("--work", default="runs/bench/recovery-work", help="each invocation logs to a new folder here")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    parser.add_argument("--no-reference", action="store_true", help="skip the failure-free run (loss not checked)")
    return parser


def run_system(key: str, job: dict, folder: Path, head: RayHead | None, undying_set: list[str]) -> dict:
    """One run of the system `key` of SYSTEMS in `folder`, with the load average at its start."""
    name, undying_sets = SYSTEMS[key]
    load = os.getloadavg()[0]
    if undying_sets is not None:
        record = run_undying(job, folder, head, undying_sets + undying_set)
    elif key == "raytrain":
        record = run_raytrain(job, folder, head)
    else:
        record = run_torchrun(job, folder)
    record.update(system=name, load_1min=load)
    return record


def run_systems(args, job: dict, work: Path) -> tuple[dict[str, list[dict]], str | None]:
    """Every system of --systems --repeats times; the runs by table name, and the Ray head's temp dir."""
    runs: dict[str, list[dict]] = {SYSTEMS[key][0]: [] for key in args.systems}
    needs_ray = {key for key in args.systems if key.startswith("undying") or key == "raytrain"}
    head = start_head(num_cpus=max(8, job["world_size"] + 1)) if needs_ray else None
    try:
        for i in range(args.repeats):  # interleaved, so drift on the machine hits every system alike
            for key in args.systems:
                record = run_system(key, job, work / f"{key}-{i}", head, args.undying_set)
                runs[record["system"]].append(record)
                print(f"[{i + 1}/{args.repeats}] {record['system']}: detection {record['detection_s']:.3f} s, "
                      f"kill-to-first-step {record['kill_to_first_step_s']:.2f} s, {record['steps_redone']} steps "
                      f"redone, wall {record['wall_s']:.1f} s, final loss {record['final_loss']:.6f}", flush=True)
    finally:
        if head is not None:
            head.stop()
    return runs, head.temp_dir if head else None  # Ray's and Ray Train's logs stay in the temp dir


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    os.chdir(ROOT)
    command = shlex.join([".venv/bin/python", "-m", "bench.recovery", *(argv if argv is not None else sys.argv[1:])])
    job = job_from_spec(args.spec, args.overrides)
    work = ROOT / args.work / time.strftime("%Y%m%d-%H%M%S")
    print(f"$ {command}\nwork directories and logs in {work}", flush=True)

    reference = None
    if not args.no_reference:
        reference = run_torchrun(job, work / "reference", kill=False)
        print(f"reference (torchrun, no kill): final loss {reference['final_loss']:.6f}, "
              f"wall {reference['wall_s']:.1f} s", flush=True)
    runs, ray_temp_dir = run_systems(args, job, work)

    ref_loss = reference["final_loss"] if reference else None
    summary = {name: summarise(records, ref_loss) for name, records in runs.items()}
    table = tables(summary, ref_loss)
    result = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine(), "job": job,
              "ray_temp_dir": ray_temp_dir, "repeats": args.repeats, "reference": reference, "summary": summary,
              "runs": runs, "table": table}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print("\n" + table + f"\n\nresults: {out}\nreproduce: {command}")
    if args.docs:
        write_docs(ROOT / args.docs, docs_section(result))
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0
