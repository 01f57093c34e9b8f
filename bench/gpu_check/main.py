"""The GPU check: `make gpu-check` (or `python -m bench.gpu_check`) on a machine with NVIDIA GPUs.

It proves, on this machine, in under eight minutes on one H200 (planned, not yet measured; docs/benchmarks.md):
  * NCCL: a process group of one process per visible GPU runs the collectives the engine uses
    and every rank's values are checked (bench.gpu_check.collectives), then trains the engine
    with DDP and ZeRO-3 against one process (.engine_parity); with one GPU the group is a world
    of one, and the table says nothing was exchanged;
  * training: bf16 steps of the `llama3.2-1b` preset through the engine with the spec's
    defaults (`train.deterministic` as the spec defaults it, fused AdamW): tokens/s and MFU against the device's
    dense bf16 peak (bench.gpu_check.peaks), at least 40 % on the default run;
  * memory: torch.cuda.max_memory_reserved against the cost model's predicted peak, within
    15 %, without and with recomputation;
  * compile on and off: the same run with each transformer block compiled;
  * determinism: its cost (the default run with `train.deterministic` flipped), and a rerun
    and a resumed run giving bitwise the same losses;
  * checkpoint staging: the device -> pinned host copy rate, and both checkpoint writers'.
It prints one table (bench.gpu_check.verdict), writes the raw figures to `--out` (default
`runs/gpu_check.json`: each check's seconds and each run's step times among them) and, with
`--markdown`, the table as Markdown for docs/benchmarks.md. Exit status: 0 all within tolerance,
1 any check out of tolerance or raising; 3 no CUDA device (nothing checked). A torch older than
undying's pin is said on a row of its own, and the checks run. The figures go to `--out` after
every check, so a run cut short (a time limit) still leaves those taken.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench.gpu_check.verdict import EXIT_NO_CUDA, INFO, NOT_TESTED, Row, exit_code, format_markdown, format_table

ROOT = Path(__file__).resolve().parents[2]
MFU_JUDGED_PRESETS = ("llama3.2-1b",)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check.json"), help="where the raw figures go (JSON)")
    parser.add_argument("--markdown", default=None, help="also write the table here as Markdown")
    parser.add_argument("--preset", default="llama3.2-1b", help="model of the training and memory runs")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="samples per step (one microbatch; default 8 on a device of 100 GB or more, else 4: "
                             "the cost model puts 8 x 2048 tokens of llama3.2-1b at 75 GiB)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--recompute", nargs="+", default=["none", "block"], choices=["none", "selective", "block"],
                        help="recomputation modes whose peak memory is checked (the first is the default run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled run")
    parser.add_argument("--no-deterministic-cost", action="store_true",
                        help="skip the run with train.deterministic flipped (its step time against the default's)")
    parser.add_argument("--resume-preset", default="small", help="model of the determinism and resume check")
    parser.add_argument("--min-mfu", type=float, default=0.40)
    parser.add_argument("--memory-tolerance", type=float, default=0.15)
    parser.add_argument("--min-staging-gbps", type=float, default=10.0)
    return parser.parse_args(argv)


def torch_too_old(version: str) -> str | None:
    """Why this torch is not one undying supports (older than pyproject.toml's torch>=X: a GPU image's
    own torch may be), or None. The checks still run (a GPU machine's time is scarce; on torch 2.11
    the check's and the engine's tests pass, docs/benchmarks.md): each one that needs a newer API
    fails as its own row, and this is an info row of its own."""
    import re

    wanted = re.search(r'"torch>=([0-9.]+)', (ROOT / "pyproject.toml").read_text())
    have = tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])
    need = tuple(int(p) for p in wanted.group(1).split(".")) if wanted else ()
    if have >= need:
        return None
    return (f"torch {version} is older than the torch>={wanted.group(1)} undying needs: a check that needs a newer "
            "API fails on its own row; run it with a Python whose CUDA torch is that new (GPU_PYTHON=...)")


def compile_toolchain_missing() -> str | None:
    """What inductor needs on a GPU that this machine lacks (a runtime image often has no compiler)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not (shutil.which("gcc") or shutil.which("cc")):
        return "no C compiler (inductor builds Triton's launchers with one)"
    return None


def nvidia_smi() -> dict:
    """The driver, the SM clock's ceiling and the power limit (what a low MFU is read against); {} without
    nvidia-smi."""
    import subprocess

    fields = ("driver_version", "clocks.max.sm", "clocks.sm", "power.limit")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(fields, (v.strip() for v in out[0].split(",")), strict=False)) if out else {}


def no_cuda_message(torch) -> str:
    build = f"torch {torch.__version__}" + (", a CPU-only build" if torch.version.cuda is None else "")
    return f"gpu-check: no CUDA device ({build}); nothing was checked. Run it on a machine with an NVIDIA GPU."


def attempt(rows: list[Row], check: str, fn: Callable[[], list[Row]]) -> None:
    """Run one check; a check that raises becomes a failed row, and the others still run."""
    from bench.gpu_check.judge import failed_row

    try:
        rows.extend(fn())
    except Exception:
        traceback.print_exc()
        rows.append(failed_row(check, traceback.format_exc()))


class Checks:
    """Every check in turn on this machine's GPUs, in a fixed order; the raw measurements go
    into `result`, the verdicts into `rows`. One instance per run of the check."""

    def __init__(self, args: argparse.Namespace, result: dict, save: Callable[[list[Row]], None] = lambda rows: None):
        """`save(rows)` is called after each check: a run cut short still leaves every figure taken."""
        import torch

        from bench.gpu_check.peaks import bf16_peak

        self.args, self.result, self.rows, self.save = args, result, [], save
        self.name = torch.cuda.get_device_name(0)
        self.peak = bf16_peak(self.name)
        self.runs: dict = {}
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        props = torch.cuda.get_device_properties(0)
        result.update(device=self.name, gpus=torch.cuda.device_count(), torch=torch.__version__,
                      cuda=torch.version.cuda, nccl=nccl, bf16_peak=self.peak, total_memory=props.total_memory,
                      sm_count=props.multi_processor_count, nvidia_smi=nvidia_smi())
        self.rows += [Row("device", f"{torch.cuda.device_count()} x {self.name}",
                          f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}"),
                      Row("bf16 dense peak", f"{self.peak / 1e12:.0f} TFLOP/s" if self.peak else "unknown peak",
                          "the MFU denominator")]

    def run(self) -> list[Row]:
        args, default = self.args, self.args.recompute[0]
        self._attempt("checkpoint staging", self.staged)
        self._attempt(f"{args.preset} rc={default}", lambda: self.train(default, compile=False))
        # After the engine, which must be the first to use cuBLAS in this process: torch sizes a cuBLAS
        # workspace from CUBLAS_WORKSPACE_CONFIG (the engine sets it in deterministic mode) when it
        # first allocates one, and keeps it; early, so that the anchor is taken whatever hangs later.
        self._attempt("bf16 matmul", self.matmul)
        if not args.no_compile:
            self._attempt(f"{args.preset} compiled", lambda: self.train(default, compile=True))
        for recompute in args.recompute[1:]:
            self._attempt(f"{args.preset} rc={recompute}", lambda rc=recompute: self.train(rc, compile=False))
        if not args.no_deterministic_cost:
            self._attempt(f"{args.preset} deterministic flipped", self.deterministic_cost)
        self._attempt("determinism and resume", self.resume)
        self._attempt("nccl process group", self.nccl_group)  # last: its own processes, bounded, may hang
        return self.rows

    def _attempt(self, check: str, fn: Callable[[], list[Row]]) -> None:
        started = time.perf_counter()
        attempt(self.rows, check, fn)
        self.result.setdefault("elapsed_s", {})[check] = time.perf_counter() - started  # the time budget's
        self.save(self.rows)

    def matmul(self) -> list[Row]:
        from bench.gpu_check.peaks import measured_matmul_tflops

        self.result["matmul_tflops"] = tflops = measured_matmul_tflops()
        share = f" = {tflops * 1e12 / self.peak:.0%} of peak" if self.peak else ""
        return [Row("bf16 8192^3 matmul", f"{tflops:.0f} TFLOP/s{share}", "anchor", INFO)]

    def nccl_group(self) -> list[Row]:
        import torch

        from bench.gpu_check import collectives

        self.result["collectives"] = got = collectives.run_collectives(torch.cuda.device_count(), "nccl")
        return collectives.collective_rows(got)

    def staged(self) -> list[Row]:
        from bench.gpu_check import judge, staging

        self.result["pinned_copy"] = raw = staging.pinned_copy()
        self.result["staging"] = pool = staging.staging_check()
        self.result["process_writer"] = procw = staging.process_writer_check()
        return judge.staging_rows(raw, pool, procw, self.args.min_staging_gbps)

    def train(self, recompute: str, compile: bool) -> list[Row]:
        from bench.gpu_check import judge, training

        args = self.args
        if compile and (missing := compile_toolchain_missing()):  # the machine's lack, not the engine's fault
            return [Row(f"{args.preset} compiled", f"not run: {missing}", "torch.compile (inductor)", NOT_TESTED)]
        run = training.train_run(args.preset, args.seq_len, args.micro_batch, args.steps, args.warmup,
                                 recompute, compile)
        self.runs[(recompute, compile)] = run
        self.result.setdefault("train", []).append(run)
        default = recompute == args.recompute[0] and not compile
        judged = default and args.preset in MFU_JUDGED_PRESETS
        rows = [judge.throughput_row(run, self.peak, self.name, args.min_mfu, judged)]
        if compile:
            eager = self.runs.get((recompute, False))
            return rows + ([judge.compile_row(eager, run)] if eager else [])
        return rows + [judge.memory_row(run, args.memory_tolerance)]

    def deterministic_cost(self) -> list[Row]:
        from bench.gpu_check import judge, training

        args, default = self.args, self.runs[(self.args.recompute[0], False)]
        flipped = training.train_run(args.preset, args.seq_len, args.micro_batch, args.steps, args.warmup,
                                     args.recompute[0], deterministic=not default["deterministic"])
        self.result["deterministic_flipped"] = flipped
        return [judge.deterministic_cost_row(default, flipped)]

    def resume(self) -> list[Row]:
        from bench.gpu_check import judge, training

        self.result["resume"] = res = training.resume_run(self.args.resume_preset, 512, 4, steps=3)
        return judge.determinism_rows(res)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(no_cuda_message(torch), file=sys.stderr)
        return EXIT_NO_CUDA
    if args.micro_batch is None:
        args.micro_batch = 8 if torch.cuda.get_device_properties(0).total_memory >= 100e9 else 4
    too_old = torch_too_old(torch.__version__)
    first = [Row("torch version", torch.__version__, "older than undying's torch pin", INFO)] if too_old else []
    if too_old:
        print(f"gpu-check: {too_old}", file=sys.stderr)
    result: dict = {"args": vars(args)}
    out = Path(args.out)
    save = functools.partial(save_result, out, result, first)
    try:
        rows = first + Checks(args, result, save).run()
    except Exception:  # the set-up itself (an import, the device's name): the figures so far still go out
        from bench.gpu_check.judge import failed_row

        traceback.print_exc()
        rows = first + [failed_row("set-up", traceback.format_exc())]
    print(format_table(rows))
    save(rows[len(first):], complete=True)
    print(f"measurements: {out}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(format_markdown(rows) + "\n")
        print(f"markdown table: {args.markdown}")
    return exit_code(rows)


def save_result(out: Path, result: dict, first: list[Row], rows: list[Row], complete: bool = False) -> None:
    """Write the raw figures and the rows so far to `out` (replaced whole: never a torn file); `complete`
    only once every check ran (a run cut short reads as such, not as a pass)."""
    rows = first + rows
    result.update(rows=[row.to_json() for row in rows], exit_code=exit_code(rows), complete=complete)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(out)
