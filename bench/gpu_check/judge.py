"""Measurements of the GPU check turned into table rows against their tolerances.

Pure functions of the dicts that bench.gpu_check.training and .staging return (and of the
device's peak), so every tolerance and verdict is unit-tested without a GPU. The targets:

  MFU            at least `min_mfu` (40 %) of the dense bf16 peak for the default run
                 (recompute none, compile off: what a spec gets by default); other runs' MFU
                 is reported, not judged. No known peak: `unknown`, never a guess.
  peak memory    the cost model's predicted peak within `tolerance` (15 %) of
                 torch.cuda.max_memory_reserved, each recomputation mode: the prediction holds
                 the caching allocator's fragmentation and cuBLAS's workspace, which the
                 allocated peak leaves out (trainer.costmodel.memory; allocated is shown beside).
  compile        compiled and eager runs start from the same weights and data: their first
                 losses agree within `COMPILE_LOSS_RTOL` (bf16 kernels differ in rounding);
                 the speed-up is reported.
  determinism    with the spec's default `deterministic: true`, a rerun's losses and a resumed
                 run's loss equal the straight run's bitwise; with the default off, within
                 `NONDETERMINISTIC_RTOL`.
  staging        exact and pinned, and at least `min_gbps`; the rate beside the raw pinned
                 copy's (the anchor measured in the same run).
"""

from __future__ import annotations

import math

from bench.gpu_check.peaks import mfu
from bench.gpu_check.verdict import FAIL, INFO, UNKNOWN, Row, gib, judged, within_relative

COMPILE_LOSS_RTOL = 1e-2
NONDETERMINISTIC_RTOL = 1e-3


def _label(run: dict) -> str:
    parts = [run["preset"], f"rc={run['recompute']}"]
    if run.get("compile"):
        parts.append("compiled")
    return " ".join(parts)


def throughput_row(run: dict, peak: float | None, device: str, min_mfu: float, judge_mfu: bool) -> Row:
    """Step time, tokens/s and MFU of one `train_run`; judged against `min_mfu` if `judge_mfu`."""
    speed = f"{run['step_s'] * 1e3:.0f} ms/step, {run['tokens_per_s'] / 1e3:.1f}k tok/s"
    target = f"MFU >= {min_mfu:.0%}" if judge_mfu else "reported"
    value = mfu(run["tokens_per_s"], run["flops_per_token"], peak)
    if value is None:
        return Row(f"{_label(run)} bf16", f"{speed}, MFU unknown peak ({device!r} not in the table)", target, UNKNOWN)
    measured = f"{speed}, MFU {value:.1%} of {peak / 1e12:.0f} TFLOP/s"
    if not judge_mfu:
        return Row(f"{_label(run)} bf16", measured, target, INFO)
    return judged(f"{_label(run)} bf16", measured, target, value >= min_mfu)


def memory_row(run: dict, tolerance: float) -> Row:
    """The cost model's predicted peak against the measured reserved peak of one `train_run`, less
    what was reserved before its engine was built (an earlier run's leftovers are not this run's)."""
    before = run.get("reserved_before", 0)
    measured, predicted = run["max_memory_reserved"] - before, run["predicted"]["total"]
    allocated = run["max_memory_allocated"] - run.get("allocated_before", 0)
    ratio = predicted / measured if measured > 0 else math.inf
    text = (f"reserved {gib(measured)} (allocated {gib(allocated)}"
            + (f"; {gib(before)} held before the build, not counted" if before else "")
            + f"), predicted {gib(predicted)} = {ratio:.2f}x")
    return judged(f"{run['preset']} peak memory rc={run['recompute']}", text,
                  f"predicted within {tolerance:.0%}", within_relative(predicted, measured, tolerance))


def compile_row(eager: dict, compiled: dict) -> Row:
    """Compiled against eager, same workload: first losses agree, speed-up reported."""
    a, b = eager["losses"][0], compiled["losses"][0]
    finite = all(math.isfinite(x) for x in eager["losses"] + compiled["losses"])
    agree = finite and abs(b - a) <= COMPILE_LOSS_RTOL * abs(a)
    speedup = eager["step_s"] / compiled["step_s"]
    text = f"{speedup:.2f}x eager speed, first loss {b:.4f} vs {a:.4f} ({compiled['compile_via']})"
    return judged(f"{compiled['preset']} compile on/off", text, f"losses within {COMPILE_LOSS_RTOL:.0%}", agree)


def deterministic_cost_row(default: dict, flipped: dict) -> Row:
    """Step time with `train.deterministic` at its default against the other setting (info: the
    figure the default is chosen by)."""
    on, off = (default, flipped) if default["deterministic"] else (flipped, default)
    cost = on["step_s"] / off["step_s"] - 1
    text = (f"on {on['step_s'] * 1e3:.0f} ms/step, off {off['step_s'] * 1e3:.0f} ms/step: deterministic "
            f"costs {cost:+.1%} (default {'on' if default['deterministic'] else 'off'})")
    return Row(f"{default['preset']} deterministic cost", text, "reported", INFO)


def losses_equal(got: list[float], want: list[float], exact: bool) -> bool:
    if len(got) != len(want) or not all(math.isfinite(x) for x in got + want):
        return False
    if exact:
        return got == want
    return all(abs(g - w) <= NONDETERMINISTIC_RTOL * abs(w) for g, w in zip(got, want, strict=True))


def determinism_rows(res: dict) -> list[Row]:
    """The spec's default `deterministic` applied, run-to-run agreement, exact resume, and the
    fused AdamW step counter restored onto the device."""
    exact = res["deterministic"]
    how = "bitwise" if exact else f"within {NONDETERMINISTIC_RTOL:g}"
    rows = [judged("deterministic default", f"train.deterministic={res['deterministic']} (the default), torch "
                   f"deterministic algorithms {'on' if res['deterministic_algorithms'] else 'off'}",
                   "the default applied", res["deterministic"] == res["deterministic_algorithms"])]
    rerun_ok = losses_equal(res["rerun"], res["straight"][:-1], exact)
    rows.append(judged(f"{res['preset']} rerun", f"{len(res['rerun'])} losses " + ("equal" if rerun_ok else
                       f"differ: {res['rerun']} vs {res['straight'][:-1]}"), f"{how} equal", rerun_ok))
    resume_ok = losses_equal([res["resumed"]], res["straight"][-1:], exact)
    rows.append(judged(f"{res['preset']} resume", f"step {res['steps'] - 1} loss {res['resumed']:.6f} vs straight "
                       f"{res['straight'][-1]:.6f}", f"{how} equal", resume_ok))
    on_device = res["restored_step_devices"] and all(d.startswith("cuda") for d in res["restored_step_devices"])
    fused_ok = bool(res["fused_adamw"] and on_device)
    rows.append(judged("fused AdamW", f"fused={res['fused_adamw']}, restored step on "
                       f"{', '.join(res['restored_step_devices']) or 'nothing'}", "fused, step on the GPU", fused_ok))
    return rows


def staging_rows(raw: dict, staging: dict, procw: dict, min_gbps: float) -> list[Row]:
    """The pinned copy (anchor, info) and the two writers' staging, judged."""
    rows = [Row("pinned copy d->h", f"{raw['mib']} MiB at {raw['gbps']:.1f} GB/s", "anchor", INFO)]
    for name, got in (("ckpt staging pool", staging), ("ckpt writer process", procw)):
        ok = got["ok"] and got["gbps"] >= min_gbps
        text = (f"{got['mib']} MiB warm {got['warm_s'] * 1e3:.0f} ms = {got['gbps']:.1f} GB/s "
                f"({got['gbps'] / raw['gbps']:.0%} of pinned copy), exact={got['exact']}, pinned={got['pinned']}")
        rows.append(judged(name, text, f"exact, pinned, >= {min_gbps:g} GB/s", ok))
    return rows


def failed_row(check: str, error: str) -> Row:
    """A check that raised: the last line of its error, as a failure."""
    lines = error.strip().splitlines() or ["(no message)"]
    return Row(check, f"raised: {lines[-1]}"[:160], "runs", FAIL)
