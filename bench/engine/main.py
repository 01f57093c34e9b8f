"""Engine step time per parallel layout: the same model and global batch on every (dp, tp, pp, zero) layout.

    .venv/bin/python -m bench.engine [--layouts dp2tp1z0 dp1pp2:gpipe ...] [--steps N] [--model SPEC]
                                     [--max-world 4] [--json PATH] [--docs docs/benchmarks.md]

Each layout trains `--warmup` + `--steps` steps of one model (`--model`: a preset name and/or key=value
dimensions, comma-separated) on local processes joined by `tests.dist._launch.run_ranks` (gloo, one thread
each, on CPU; NCCL, one GPU each, in bf16, when CUDA is available). All layouts of one world size share one
launch of ranks (bench/engine/worker.py). The single-process layout dp1tp1pp1z0 is the reference: same
model, same global batch, world 1. Per layout it reports, over the measured steps only:
  * median step time: per step the slowest rank's wall time (the ranks run in lockstep), then the median;
  * that time relative to the reference, and tokens/s = global tokens per step / median step time;
  * bubble: the mean over ranks of the median `StepResult.bubble` (the pipeline's measured idle fraction),
    "-" for pp = 1 or when the engine does not report it;
  * max Δloss vs ref: max |loss - reference loss| over every step, warm-up included: a correctness sanity check (every
    layout trains the same batches from the same initial weights, so it is ~0 up to reduction order);
  * MFU = flops_per_token x tokens/s / (world x peak). On GPU the peak is the hardware table's
    (trainer.costmodel.hardware); on CPU it is the matmul peak measured here by one single-threaded
    process, as the controller measures it, so the CPU figure is labelled "vs measured".
Layouts the engine refuses, or that fail, keep their row with the error in place of the numbers.

It prints the table, writes --json and rewrites its own section of --docs (notes between the NOTES
markers are kept). Layouts of world 8 are left out unless --max-world 8.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.docs import replace_section
from trainer.config import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Engine step time by parallel layout"
NOTES = ("<!-- engine-notes: kept when python -m bench.engine rewrites this section -->", "<!-- /engine-notes -->")
REFERENCE = "dp1tp1pp1z0"
# Small enough for 4 ranks on 2 cores in a few minutes, big enough that compute is not all overhead;
# 4 layers cut into 2 or 4 pipeline chunks, and every width splits over tp = 2.
DEFAULT_MODEL = "vocab_size=2048,n_layers=4,n_heads=4,d_model=128,d_ff=512,max_seq_len=256"
LAYOUT_RE = re.compile(r"^dp(\d+)(?:tp(\d+))?(?:pp(\d+))?(?:z([0-3]))?(?::([a-z0-9-]+))?$")
COLUMNS = ("layout", "world", "median step", "vs ref", "tokens/s", "bubble", "max Δloss vs ref", "MFU")


def parse_layout(text: str) -> dict:
    """`dp2tp2pp1z1`, `dp1pp2:gpipe`: omitted degrees are 1, zero 0, schedule 1f1b."""
    match = LAYOUT_RE.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"layout {text!r}: write it as dpNtpNppNzK[:schedule], e.g. dp2tp2z1")
    dp, tp, pp, zero, schedule = match.groups()
    return {"dp": int(dp), "tp": int(tp or 1), "pp": int(pp or 1), "zero": int(zero or 0),
            "schedule": schedule or "1f1b"}


def label(layout: dict) -> str:
    text = f"dp{layout['dp']}tp{layout['tp']}pp{layout['pp']}z{layout['zero']}"
    return text + (f":{layout['schedule']}" if layout["pp"] > 1 else "")


def world_of(layout: dict) -> int:
    return layout["dp"] * layout["tp"] * layout["pp"]


def default_layouts(max_world: int) -> list[dict]:
    """pp=1: {dp 1,2,4,8} x {tp 1,2} x zero 0..3 (zero only where dp > 1: with dp = 1 the engine applies none);
    pp=2: 1F1B on the same grid with zero 0 and 2, plus GPipe and interleaved 1F1B at dp1tp1. World <= max_world."""
    out = []
    for pp in (1, 2):
        for tp in (1, 2):
            for dp in (1, 2, 4, 8):
                zeros = (0,) if dp == 1 else (0, 1, 2, 3) if pp == 1 else (0, 2)
                out += [{"dp": dp, "tp": tp, "pp": pp, "zero": z, "schedule": "1f1b"} for z in zeros]
    out += [{"dp": 1, "tp": 1, "pp": 2, "zero": 0, "schedule": s} for s in ("gpipe", "interleaved")]
    return [layout for layout in out if world_of(layout) <= max_world]


def parse_model(text: str) -> dict:
    """`tiny`, `small,n_layers=4`, or `vocab_size=...,d_model=...`: ModelConfig keyword arguments."""
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            if item not in MODEL_PRESETS:
                raise argparse.ArgumentTypeError(f"unknown preset {item!r}; presets: {', '.join(MODEL_PRESETS)}")
            out["preset"] = item
            continue
        key, value = (s.strip() for s in item.split("=", 1))
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def run_world(job: dict, world: int, layouts: list[dict], backend: str) -> dict:
    """Every rank's records for `layouts` (one launch; on failure one launch per layout, to isolate it)."""
    from bench.engine.worker import train_layouts
    from tests.dist._launch import free_port, run_ranks

    def launch(group: list[dict]) -> list[dict]:
        timeout = 120 + 60 * len(group) * max(1, job["steps"] // 5)
        return run_ranks(train_layouts, world, args=(job, group, backend, free_port()), timeout_s=timeout)

    try:
        return {"ranks": launch(layouts), "layouts": layouts}
    except Exception as error:  # noqa: BLE001 - a failing launch is reported per layout, not fatal
        if len(layouts) == 1:
            return {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"}
    per_layout = [run_world(job, world, [layout], backend) for layout in layouts]
    return {"split": per_layout, "layouts": layouts}


def collect(job: dict, layouts: list[dict], backend: str, gpus: int) -> tuple[dict, float | None, list[float]]:
    """{label: rank records or error} over all layouts, the CPU peak (FLOP/s) and the load averages seen."""
    ref = parse_layout(REFERENCE)
    wanted = [ref] + [layout for layout in layouts if label(layout) != REFERENCE]
    by_world: dict[int, list[dict]] = {}
    for layout in wanted:
        by_world.setdefault(world_of(layout), []).append(layout)
    records, peak, loads = {}, None, []
    for world in sorted(by_world):
        group = by_world[world]
        if backend == "nccl" and world > gpus:
            records.update({label(x): {"error": f"needs {world} GPUs, this machine has {gpus}"} for x in group})
            continue
        loads.append(os.getloadavg()[0])
        started = time.perf_counter()
        print(f"world {world}: {', '.join(label(x) for x in group)}", flush=True)
        out = run_world(job, world, group, backend)
        for result in out.get("split", [out]):
            for index, layout in enumerate(result.get("layouts", group)):
                if "error" in result:
                    records[label(layout)] = {"error": result["error"]}
                    continue
                ranks = [r["layouts"][index] for r in result["ranks"]]
                error = next((r["error"] for r in ranks if "error" in r), None)
                records[label(layout)] = {"error": error} if error else {"ranks": [r["steps"] for r in ranks]}
                peak = result["ranks"][0].get("cpu_peak_flops", peak)
        print(f"world {world}: {time.perf_counter() - started:.0f} s", flush=True)
    loads.append(os.getloadavg()[0])
    return records, peak, loads


def summarise(job: dict, layouts: list[dict], records: dict, peak: float | None) -> list[dict]:
    """One row per layout (reference first): the module docstring's numbers, or the error."""
    from trainer.config import ModelConfig
    from trainer.model import flops_per_token

    fpt = flops_per_token(ModelConfig(**job["model"]), job["seq_len"])
    warm = job["warmup"]
    ref_rec = records[REFERENCE]
    ref_losses = [s["loss"] for s in ref_rec["ranks"][0]] if "ranks" in ref_rec else None
    rows, ref_step = [], None
    order = [parse_layout(REFERENCE)] + [x for x in layouts if label(x) != REFERENCE]
    for layout in order:
        name, world = label(layout), world_of(layout)
        rec = records[name]
        row = {"layout": name, "world": world, **layout}
        if "error" in rec:
            rows.append({**row, "error": rec["error"]})
            continue
        ranks = rec["ranks"]
        step_s = statistics.median(max(r[i]["step_s"] for r in ranks) for i in range(warm, len(ranks[0])))
        ref_step = step_s if name == REFERENCE else ref_step
        tokens = ranks[0][-1]["tokens"]
        bubbles = [r[i]["bubble"] for r in ranks for i in range(warm, len(r))]
        bubble = None
        if layout["pp"] > 1 and None not in bubbles:
            bubble = statistics.mean(statistics.median(s["bubble"] for s in r[warm:]) for r in ranks)
        losses = [s["loss"] for s in ranks[0]]
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) if ref_losses else None
        tok_s = tokens / step_s
        rows.append({**row, "step_s": step_s, "vs_ref": step_s / ref_step if ref_step else None,
                     "tokens_per_s": tok_s, "bubble": bubble, "max_loss_diff": diff,
                     "final_loss": losses[-1], "mfu": fpt * tok_s / (world * peak) if peak else None,
                     "compute_s": statistics.median(max(r[i]["compute_s"] for r in ranks)
                                                    for i in range(warm, len(ranks[0])))})
    return rows


def table(rows: list[dict], mfu_label: str) -> str:
    head = [c if c != "MFU" else mfu_label for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['layout']} | {row['world']} | refused or failed: "
                         f"{row['error'].replace('|', '/')} |" + " |" * (len(head) - 3))
            continue
        cells = [row["layout"], str(row["world"]), f"{row['step_s'] * 1e3:.0f} ms",
                 f"{row['vs_ref']:.2f}x" if row["vs_ref"] else "-", f"{row['tokens_per_s']:.0f}",
                 "-" if row["bubble"] is None else f"{row['bubble']:.1%}",
                 "-" if row["max_loss_diff"] is None else f"{row['max_loss_diff']:.1e}",
                 "-" if row["mfu"] is None else f"{row['mfu']:.1%}" + (" (over the peak: not comparable)"
                                                                         if row["mfu"] > 1 else "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(backend: str) -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    gpu = torch.cuda.get_device_name(0) if backend == "nccl" else "no GPU"
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu,
            "versions": f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
                        f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if backend == "nccl" else "")}


def docs_section(result: dict) -> str:
    job, m, loads = result["job"], result["machine"], result["load_averages"]
    peak = result["peak_flops"]
    peak_text = (f"the hardware table's {job['precision']} peak of {m['gpu']}, {peak / 1e12:.0f} TFLOP/s per GPU"
                 if result["backend"] == "nccl" else
                 f"the fp32 matmul peak measured here by one single-threaded process, {peak / 1e9:.1f} GFLOP/s, "
                 "times the world size (the ranks run one thread each; with more ranks than cores they share "
                 "the cores, so the CPU MFU of a world > cores layout is bounded by cores / world)"
                 if peak else "not measured")
    model = ", ".join(f"{k}={v}" for k, v in job["model"].items())
    return f"""{SECTION}

Measured by `python -m bench.engine` on {result['date']}. Command:

```bash
{result['command']}
```

Machine: {m['cores']} cores ({m['cpu']}), {m['gpu']}; {m['versions']}.
The 1-minute load average was {min(loads):.1f} to {max(loads):.1f} during the run (sampled before each launch
of ranks and at the end), on {m['cores']} cores (what else ran, if anything, is said in the notes).

Job: model {model}; sequence length {job['seq_len']}; global batch {job['global_batch']} samples, micro-batch
{job['micro_batch']}; {job['precision']}; {result['backend']}, {'one GPU' if result['backend'] == 'nccl' else
'one thread'} per rank; {job['warmup']} warm-up step(s), then {job['steps']} measured steps per layout. The
reference is {REFERENCE}: the same model and global batch on one process.

{result['table']}

- median step: per measured step the slowest rank's wall time, then the median; vs ref divides it by the
  reference's. tokens/s: global tokens per step / median step.
- bubble: measured idle fraction of the pipeline schedule (`StepResult.bubble`), mean over ranks of each
  rank's median; "-" without a pipeline.
- max Δloss vs ref: largest absolute difference from the reference's loss over every step, warm-up included; the
  layouts train the same batches from the same weights, so it is ~0 (reduction order only).
- MFU: flops_per_token x tokens/s / (world x peak), with the peak
  {peak_text}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", type=parse_layout, default=None, metavar="LAYOUT",
                        help="e.g. dp2tp2z1 dp1pp2:gpipe (default: every layout of world <= --max-world)")
    parser.add_argument("--max-world", type=int, default=4, help="largest world of the default layouts (8 adds dp8...)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per layout")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and left out of the timing")
    parser.add_argument("--model", type=parse_model, default=parse_model(DEFAULT_MODEL),
                        help=f"preset and/or dimensions, comma-separated (default {DEFAULT_MODEL})")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--json", default="runs/bench/engine.json", help="results file ('' to skip)")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    args = parser.parse_args(argv)
    import torch

    from trainer.costmodel.hardware import GPUS

    os.chdir(ROOT)
    command = shlex.join([".venv/bin/python", "-m", "bench.engine", *(argv if argv is not None else sys.argv[1:])])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus else "gloo"
    job = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch,
           "micro_batch": args.micro_batch, "steps": args.steps, "warmup": args.warmup,
           "precision": "bf16" if gpus else "fp32", "deterministic": not gpus}
    layouts = args.layouts or default_layouts(args.max_world)
    print(f"$ {command}\n{len(layouts)} layouts on {backend}", flush=True)
    started, date = time.perf_counter(), time.strftime("%Y-%m-%d")
    records, peak, loads = collect(job, layouts, backend, gpus)
    if gpus:
        name = torch.cuda.get_device_name(0).lower()
        row = next((GPUS[key] for key in GPUS if key in name), None)
        peak = row.peak(job["precision"]) if row else None
        mfu_label = f"MFU ({job['precision']}, table peak)"
    else:
        mfu_label = "MFU (CPU, vs measured matmul peak)"
    rows = summarise(job, layouts, records, peak)
    text = table(rows, mfu_label)
    result = {"command": command, "date": date, "backend": backend, "machine": machine(backend), "job": job,
              "peak_flops": peak, "load_averages": loads, "wall_s": time.perf_counter() - started,
              "rows": rows, "table": text}
    print("\n" + text + f"\n\nwall {result['wall_s']:.0f} s; load average {min(loads):.1f}-{max(loads):.1f}")
    if args.json:
        out = ROOT / args.json
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"results: {out}")
    if args.docs:
        docs, section = ROOT / args.docs, docs_section(result)
        if NOTES[0] not in (docs.read_text() if docs.exists() else ""):
            # an empty notes block, so that hand-written notes have a place that survives the next run
            section += f"\n{NOTES[0]}\n{NOTES[1]}\n"
        replace_section(docs, SECTION, section, NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0
