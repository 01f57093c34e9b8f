"""`undying plan JOB.yaml --gpus N [--gpu h200] [--json]`: which parallel layout to run a job with.

Prints every valid (dp, tp, pp, zero, micro_batch) layout for N devices ranked by the cost
model's predicted step time (trainer/costmodel), with tokens/s, MFU and the four memory
ledgers per rank against the usable device memory, then every rejected layout grouped by
reason. Nothing is started and no storage is touched; `--gpu cpu` measures this machine
(about a second). Exit code 0 when at least one layout fits, 2 when none does or the
arguments are wrong (the CLI's "cannot run as written").
"""

from __future__ import annotations

import json

from orchestrator.cli.exits import EXIT_OK, EXIT_USAGE, fail_line
from orchestrator.spec.job_spec import JobSpec
from trainer.costmodel.hardware import DEVICE_NAMES, hardware
from trainer.costmodel.planner import Plan, capacity_bytes, plan
from trainer.model import count_params

SHOWN = 20  # valid layouts in the table; --json lists all
GiB, MiB = 1 << 30, 1 << 20


def plan_main(spec: JobSpec, gpus: int, gpu: str, as_json: bool) -> int:
    """Plan `spec` on `gpus` devices of kind `gpu` (h100, h200, a100, cpu); print a table or JSON."""
    wrong = ([f"--gpus {gpus}: must be at least 1"] if gpus < 1 else []) + (
        [f"--gpu {gpu!r}: one of {', '.join(DEVICE_NAMES)}"] if gpu.lower() not in DEVICE_NAMES else [])
    if wrong:
        return fail_line(as_json, f"undying plan: {'; '.join(wrong)}", EXIT_USAGE)
    result = plan(spec, hardware(gpu, precisions=(spec.train.precision,)), gpus)
    if as_json:
        print(json.dumps(plan_json(spec, result), indent=2))
    else:
        print(plan_table(spec, result))
    return EXIT_OK if result.valid else EXIT_USAGE


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _unit(result: Plan) -> tuple[int, str]:
    """GiB, or MiB when every valid layout needs less than a GiB (tiny models)."""
    largest = max((c.prediction.memory.total for c in result.valid), default=0)
    return (GiB, "GiB") if largest >= GiB else (MiB, "MiB")


def _header(spec: JobSpec, result: Plan, unit: str) -> list[str]:
    hw, m = result.hardware, spec.model
    return [
        f"undying plan: {spec.name} on {result.n_gpus} x {hw.name}, {spec.train.precision}, "
        f"{hw.hbm_bytes / GiB:.0f} GiB per device",
        f"model {m.preset or m.from_hf or 'custom'} ({_count(count_params(m))} parameters), global batch "
        f"{spec.train.global_batch} x {spec.data.seq_len} tokens, {spec.train.optimizer}, "
        f"pipeline schedule {spec.parallel.schedule}",
        "step time is the cost model's lower bound (docs/design.md section 1), so MFU is an upper bound; "
        f"memory in {unit} per rank",
    ]


def plan_table(spec: JobSpec, result: Plan) -> str:
    scale, unit = _unit(result)
    lines = _header(spec, result, unit) + [""]
    if result.valid:
        lines.append(f"{'#':>3}  {'layout':<28}{'step s':>8}{'tokens/s':>11}{'MFU<=':>7}"
                     f"{'state':>8}{'activ':>7}{'coll':>7}{'trans':>7}{'total / usable':>17}")
    for i, cand in enumerate(result.valid[:SHOWN], 1):
        p, mem = cand.prediction, cand.prediction.memory
        usable = capacity_bytes(result.hardware, cand.layout)
        lines.append(f"{i:>3}  {cand.layout.label():<28}{p.step_s:>8.3f}{p.tokens_per_s:>11,.0f}"
                     f"{p.mfu:>7.1%}{mem.state / scale:>8.1f}{mem.activation / scale:>7.1f}"
                     f"{mem.collective / scale:>7.1f}{mem.transient / scale:>7.1f}"
                     f"{mem.total / scale:>9.1f} / {usable / scale:<6.1f}")
    if len(result.valid) > SHOWN:
        lines.append(f"     ... {len(result.valid) - SHOWN} more valid layouts (--json lists all)")
    if not result.valid:
        lines.append(f"no layout fits on {result.n_gpus} x {result.hardware.name}")
    # Out-of-memory groups first: they are the ones a user can act on (zero, recompute, more GPUs).
    groups = sorted(result.rejected_groups(), key=lambda group: group[1][0].memory is None)
    lines += ["", f"rejected: {len(result.rejected)} layouts, {len(groups)} reasons"]
    for key, members in groups:
        first = members[0]
        if first.memory:
            text = f"{key}; closest: {first.reason}"
        else:  # the engine's refusal says the field and the fix
            text = key if first.reason == key else f"{key} -- {first.reason}"
        lines.append(f"  {len(members):>5} x {text}")
    return "\n".join(line.rstrip() for line in lines)


def plan_json(spec: JobSpec, result: Plan) -> dict:
    return {
        "job": spec.name,
        "devices": result.n_gpus,
        "hardware": result.hardware.to_json(),
        "valid": [{"layout": c.layout.to_json(), "prediction": c.prediction.to_json(),
                   "usable_bytes": capacity_bytes(result.hardware, c.layout)} for c in result.valid],
        "rejected": [{"reason": key, "count": len(members), "example": members[0].reason,
                      "layouts": [r.layout.to_json() for r in members]}
                     for key, members in result.rejected_groups()],
    }
