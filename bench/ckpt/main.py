"""Checkpoint save and load: undying's writer/reader vs torch.distributed.checkpoint, same state, one run.

    .venv/bin/python -m bench.ckpt [--size-mib 1024] [--repeats 3] [--tvp-repeats 3]
                                   [--backends file s3] [--layouts dp4 dp2 tp4]

Four gloo processes (bench/ckpt/worker.py) hold a GPT-like stack of Linear layers wrapped
with FSDP2 `fully_shard` plus its AdamW state after one step (params + exp_avg +
exp_avg_sq, --size-mib in total). On file:// (a temp dir) and s3:// (a SeaweedFS server
this script starts on free loopback ports and stops by PID, tests/s3/_seaweed.py), each
repeat saves and loads that state with
  undying  `ShardWriter.save` (async and sync) on every rank; this process plays the
           controller: it receives the receipts through a TCPStore and commits the
           manifest with ckpt.commit.Committer; `read_slices` loads the same
           layout and resharded ones (dp2: 2 ranks, row halves; tp4: column splits);
  DCP      `dcp.save`, `dcp.async_save` and `dcp.load` (FileSystemWriter/Reader on file://,
           FsspecWriter/Reader with the same endpoint and credentials on s3://);
  floor    each rank reads its own shard file in one request (`fs.cat_file`).
The first repeat bit-checks every load. Then rank 0 compares the background writer as a
thread (ShardWriter) with the same write in a child process fed through shared memory,
while a training loop runs (bench/ckpt/tvp.py). It prints the tables (median [min-max]
over the repeats, ratios against DCP, the targets of docs/benchmarks.md), writes runs/bench/ckpt.json and
rewrites its own section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

# The committer waits on the store with a short timeout so that it notices a dead rank; each
# timeout would print a C++ warning. Set before torch is imported; this process only.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from bench.ckpt.controller import commit_loop  # noqa: E402
from bench.ckpt.ops import plan  # noqa: E402
from bench.ckpt.report import (  # noqa: E402
    backend_table,
    read_lines,
    summarise,
    target_lines,
    tvp_table,
    tvp_verdict,
)
from bench.ckpt.section import SECTION, docs_section  # noqa: E402
from bench.docs import replace_section  # noqa: E402
from ckpt.staging import staging_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTES = ("<!-- ckpt-notes: kept when python -m bench.ckpt rewrites this section -->", "<!-- /ckpt-notes -->")
WORKER = "bench.ckpt.worker"  # run as `python -m` from the repository root
WORLD = 4


def machine() -> dict:
    import fsspec
    import s3fs
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0)
    return {"cores": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem_kb / 2**20), "load_at_start": os.getloadavg(),
            "versions": f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
                        f"torch {torch.__version__}, fsspec {fsspec.__version__}, s3fs {s3fs.__version__}"}


class LoadSampler:
    """The 1-minute load average every few seconds while the bench runs (the machine is shared)."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        s = self.samples
        return {"min": min(s), "max": max(s), "mean": sum(s) / len(s), "samples": len(s)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backends(kinds: list[str], work: Path, server) -> dict:
    out = {}
    if "file" in kinds:
        out["file"] = {"ours": f"file://{work}/file/ours/job", "dcp": str(work / "file" / "dcp"), "options": {}}
    if "s3" in kinds:
        from tests.s3._seaweed import BUCKET

        prefix = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        out["s3"] = {"ours": f"{prefix}/ours/job", "dcp": f"{prefix}/dcp", "options": server.storage_options}
    return out


def launch(config_path: Path, work: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        # The environment the orchestrator gives its rank processes (ckpt.staging.staging_env), for
        # every rank of both systems.
        env = {**os.environ, **staging_env(os.environ), "RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = (work / f"rank{rank}.log").open("wb")
        out = None if rank == 0 else log  # rank 0's progress lines go to the terminal
        procs.append(subprocess.Popen([sys.executable, "-m", WORKER, str(config_path)], env=env, cwd=ROOT,
                                      stdout=out, stderr=log, stdin=subprocess.DEVNULL))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run(args, work: Path) -> dict:
    """Start the S3 server (if asked), the store and the ranks; commit our saves; return the raw result."""
    import torch.distributed as dist

    from tests.s3._seaweed import start_seaweed

    server = start_seaweed(work / "seaweedfs") if "s3" in args.backends else None
    procs: list[subprocess.Popen] = []
    try:
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        config = {"size_bytes": args.size_mib * 2**20, "width": args.width, "repeats": args.repeats,
                  "tvp_repeats": args.tvp_repeats, "layouts": args.layouts,
                  "backends": backends(args.backends, work, server), "store_host": "127.0.0.1",
                  "store_port": store.port, "out": str(work / "result.json")}
        config_path = work / "config.json"
        config_path.write_text(json.dumps(config))
        ops = plan(args.backends, args.repeats, args.layouts)
        saves = [(op["step"], op["backend"]) for op in ops if "step" in op]
        procs = launch(config_path, work)
        commits = commit_loop(store, saves, config["backends"], WORLD, procs)
        for proc in procs:
            proc.wait()
        failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode]
        if failed:
            tails = "\n".join(f"--- rank {r} ---\n" + (work / f"rank{r}.log").read_text(errors="replace")[-3000:]
                              for r, _ in failed)
            raise SystemExit(f"ranks failed {failed}:\n{tails}")
        result = json.loads((work / "result.json").read_text())
        result["commits"] = commits
        if server is not None:
            result["seaweedfs"] = {"started_in_s": server.started_in_s, "pid": server.proc.pid}
        return result
    finally:
        stop(procs)
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="params + AdamW moments, all ranks together")
    parser.add_argument("--width", type=int, default=1024, help="model width (Linear layers width <-> 4 x width)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every save and load (median, range)")
    parser.add_argument("--tvp-repeats", type=int, default=3, help="thread-vs-process trials per writer (0: skip)")
    parser.add_argument("--backends", nargs="+", choices=["file", "s3"], default=["file", "s3"])
    parser.add_argument("--layouts", nargs="+", choices=["dp4", "dp2", "tp4"], default=["dp4", "dp2"],
                        help="load layouts: dp4 = the saving layout (always measured), dp2 = 2 ranks with "
                             "row halves, tp4 = weights split by columns (reads every shard on every rank)")
    parser.add_argument("--out", default="runs/bench/ckpt.json")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="markdown file to update ('' to skip)")
    parser.add_argument("--keep-work", action="store_true", help="keep the temp dir (logs, SeaweedFS data)")
    args = parser.parse_args(argv)
    args.layouts = ["dp4", *[x for x in args.layouts if x != "dp4"]]
    os.chdir(ROOT)
    command = shlex.join([".venv/bin/python", "-m", "bench.ckpt", *(argv if argv is not None else sys.argv[1:])])
    facts = machine()
    print(f"$ {command}\n{facts['cores']} cores, load average {facts['load_at_start'][0]:.1f} at start; "
          f"{facts['versions']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="undying-ckpt-bench-"))
    sampler = LoadSampler()
    started = time.time()
    try:
        result = run(args, work)
    finally:
        load = sampler.stop()
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    result.update(command=command, date=time.strftime("%Y-%m-%d"), machine=facts, load_during=load,
                  wall_s=time.time() - started, args=vars(args))
    summary = summarise(result)
    result["summary"] = summary
    text = render(result)
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n" + text + f"\n\nresults: {out}\nreproduce: {command}")
    if args.docs:
        replace_section(ROOT / args.docs, SECTION, docs_section(result, text), NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0


def render(result: dict) -> str:
    """The tables: one side-by-side table per backend with its targets, then thread vs process."""
    layouts = result["args"]["layouts"]
    parts = []
    for backend, ops in result["summary"].items():
        parts.append(f"{backend}://\n\n{backend_table(ops, layouts)}\n\n{target_lines(ops, backend, layouts)}\n"
                     + read_lines(ops, layouts, result["total_bytes"]))
    if result["tvp"]:
        parts.append("Background writer: thread vs process (rank 0's shard, a training loop running)\n\n"
                     + tvp_table(result["tvp"]) + "\n\n" + tvp_verdict(result["tvp"]))
    return "\n\n".join(parts)
