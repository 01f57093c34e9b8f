"""What a worker node's end costs a job: drained first (`undying drain-node`, a worker pod's
preStop hook) against lost without warning (every process of the node SIGKILLed), the same job,
at the same moment, in one run, one table.

    .venv/bin/python -m bench.preemption [--repeats N] [--steps N] [--after S]

The job is `examples/demo.yaml` (tiny GPT, 4 data-parallel ranks over gloo on CPU) with the
product's checkpoint defaults but `checkpoint.every_steps` (the storage level; the memory level
stays on, at its Young interval) and 2 warm spares, on a local Ray cluster of a head and three
worker nodes of 2 CPUs (4 ranks fill two nodes, the spares the third). `--after` seconds into
training the node of rank 1 ends:
  drained  `undying drain-node --node-id <it> --wait 60`, as its pod's preStop hook runs it;
           once the command returns, the node's processes are killed (the pod ends);
  lost     its raylet and rank processes, then its other Ray processes, are SIGKILLed at once (a
           pod whose node vanished, or one ended without the hook), the anchor. A best case for a loss:
           the survivors' sockets to the dead ranks reset at once, where a node that vanishes
           (power, network) is found by health checks and timeouts, seconds later.
Either way a new node then joins, as KubeRay recreates a worker pod (and Ray's GCS, which spins
while the gone node's placement-group bundles have nowhere to go, finds room for them). Each round
runs the failure-free job and the two ways, in an order rotated from round to round.
Every figure comes from the job's own report (its goodput ledger: monitor.goodput): the badput
after start-up (wall time less productive time and start-up), its excess over the failure-free
run's (the cost of the node's end), the wall time against the failure-free run's, the buckets the
cost goes to (release and re-forming, checkpoint saves and restores, lost work), the steps redone,
and whether the final loss equals the failure-free run's. It prints the table (medians over
--repeats), writes runs/bench/preemption/ (each run's log and report, result.json) and rewrites
its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.docs import write_section
from tests.ray.jobs import ROOT, UNDYING, start_job, wait_for

SECTION = "## Preemption: a drained node against a lost one"
NOTES = ("<!-- preemption-notes: kept when python -m bench.preemption rewrites this section -->",
         "<!-- /preemption-notes -->")
WAYS = ("failure-free", "drained", "lost")
WORK = ROOT / "runs/bench/preemption"


def _job(cluster, tmp: Path, name: str, steps: int, every: int) -> tuple[subprocess.Popen, Path, Path]:
    """The ray tests' job (tests/ray/jobs.py), put back to the product's memory level and keep, with
    2 warm spares and no scripted fault."""
    return start_job(cluster.address, tmp, name, [
        f"train.steps={steps}", f"checkpoint.every_steps={every}", "checkpoint.keep=3",
        "checkpoint.memory.enabled=true", "elastic.spares=2", "chaos.faults=[]"])


def _node_of_rank_1(cluster):
    """The node holding placement bundle 1 (rank 1's seat), as the cluster's node object."""
    import ray

    [table] = [t["bundles_to_node_id"] for t in ray.util.placement_group_table().values() if t["state"] == "CREATED"]
    [node] = [n for n in cluster.nodes if n.node_id == table[1]]
    return node


def _end_node(cluster, node, way: str) -> float:
    """End `node` the given way; returns how long the preStop hook took (0 for a loss)."""
    started = time.monotonic()
    if way == "drained":
        hook = subprocess.run([UNDYING, "drain-node", "--address", cluster.address, "--node-id", node.node_id,
                               "--wait", "60"], capture_output=True, text=True, timeout=120)
        if hook.returncode != 0:
            raise RuntimeError(f"drain-node exited {hook.returncode}: {hook.stdout}{hook.stderr}")
    hook_s = time.monotonic() - started if way == "drained" else 0.0
    ranks = cluster.rank_pids(node)  # found as the raylet's children, so before it goes
    for pid in [node.all_processes["raylet"][0].process.pid, *ranks]:
        os.kill(pid, signal.SIGKILL)
    cluster.cluster.remove_node(node, allow_graceful=False)
    cluster.nodes.remove(node)
    cluster.nodes.append(cluster.add_node())  # the pod's replacement joins
    return hook_s


def run_one(cluster, tmp: Path, way: str, steps: int, every: int, after_s: float) -> dict:
    proc, report, log = _job(cluster, tmp, way.replace("-", ""), steps, every)
    hook_s = 0.0
    try:
        wait_for(log, "-> RUNNING", proc, timeout_s=300.0)
        if way != "failure-free":
            time.sleep(after_s)
            hook_s = _end_node(cluster, _node_of_rank_1(cluster), way)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"the {way} run failed:\n{log.read_text()[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.restore(3)
    result = json.loads(report.read_text())
    goodput = result["goodput"]
    badput = goodput["badput_s"]
    return {"way": way, "wall_s": goodput["wall_s"], "productive_s": goodput["productive_s"],
            "after_start_s": goodput["wall_s"] - goodput["productive_s"] - badput["startup"],
            "lost_work_s": badput["lost_work"],
            "redone_steps": result["redone_steps"], "final_loss": result["final_loss"], "hook_s": hook_s,
            "dp": [w["dp"] for w in result["world_history"]], "badput_s": badput}


def run(args) -> dict:
    import ray

    from tests.ray._multinode import LocalCluster

    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private local cluster: no token to distribute
    shutil.rmtree(WORK, ignore_errors=True)
    cluster = LocalCluster(nodes=3, cpus_per_node=2)
    rounds = []
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        for round_ in range(args.repeats):
            work = WORK / f"round-{round_ + 1}"  # the runs' logs and reports stay there to be read
            work.mkdir(parents=True)
            order = WAYS[round_ % len(WAYS):] + WAYS[:round_ % len(WAYS)]
            runs = {way: run_one(cluster, work, way, args.steps, args.every_steps, args.after) for way in order}
            for way in ("drained", "lost"):
                runs[way]["cost_s"] = runs[way]["after_start_s"] - runs["failure-free"]["after_start_s"]
                runs[way]["wall_delta_s"] = runs[way]["wall_s"] - runs["failure-free"]["wall_s"]
                runs[way]["same_loss"] = runs[way]["final_loss"] == runs["failure-free"]["final_loss"]
            rounds.append(runs)
            print(f"round {round_ + 1}/{args.repeats}: " + ", ".join(
                f"{way} {runs[way]['cost_s']:.2f} s" for way in ("drained", "lost")), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"steps": args.steps, "every_steps": args.every_steps, "after_s": args.after, "rounds": rounds}


def _median(rounds: list[dict], way: str, key: str) -> float:
    return statistics.median(r[way][key] for r in rounds)


def table(result: dict) -> str:
    rounds = result["rounds"]
    for runs in rounds:  # the ledger's buckets the node's end adds to
        for way in WAYS:
            badput = runs[way]["badput_s"]
            runs[way]["reformation_s"] = badput["reformation"] + badput["detection"]
            runs[way]["checkpoints_s"] = badput["checkpoint_save"] + badput["checkpoint_restore"]
    rows = ["| the node of rank 1 | badput after start-up, s | cost of the node's end, s | wall, s (vs failure-free) | "
            "release and re-forming, s | checkpoint saves and restore, s | lost work, s | steps redone | "
            "preStop hook, s | final loss = failure-free |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for way in WAYS:
        cost = "-" if way == "failure-free" else f"**{_median(rounds, way, 'cost_s'):.2f}**"
        wall = f"{_median(rounds, way, 'wall_s'):.1f}" + (
            "" if way == "failure-free" else f" ({_median(rounds, way, 'wall_delta_s'):+.1f})")
        same = "-" if way == "failure-free" else f"{sum(r[way]['same_loss'] for r in rounds)}/{len(rounds)}"
        hook = f"{_median(rounds, way, 'hook_s'):.2f}" if way == "drained" else "-"
        rows.append(f"| {way} | {_median(rounds, way, 'after_start_s'):.2f} | {cost} | {wall} | "
                    f"{_median(rounds, way, 'reformation_s'):.2f} | {_median(rounds, way, 'checkpoints_s'):.2f} | "
                    f"{_median(rounds, way, 'lost_work_s'):.2f} | {_median(rounds, way, 'redone_steps'):.0f} | "
                    f"{hook} | {same} |")
    ratio = _median(rounds, "lost", "cost_s") / max(_median(rounds, "drained", "cost_s"), 1e-3)
    deltas = {way: ", ".join(f"{r[way]['wall_delta_s']:+.1f}" for r in rounds) for way in ("drained", "lost")}
    # Badput alone: the ledger books a step that ran slower after the node's end as productive, so
    # the wall against the failure-free run is the like-for-like figure, given beside it per round.
    rows += ["", f"Medians of {len(rounds)} round(s). Badput of the node's end: a lost node's is {ratio:.1f}x a "
                 f"drained one's. Wall against the failure-free run, per round: drained {deltas['drained']} s, "
                 f"lost {deltas['lost']} s."]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three runs (default %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="train.steps of each run (default %(default)s)")
    parser.add_argument("--every-steps", type=int, default=50, help="checkpoint.every_steps (default %(default)s)")
    parser.add_argument("--after", type=float, default=6.0,
                        help="seconds of training before the node ends (default %(default)g)")
    parser.add_argument("--docs", default="docs/benchmarks.md", help="rewrite this file's section ('' to skip)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    result = run(args)
    text = table(result)
    print(text)
    out = WORK / "result.json"
    out.write_text(json.dumps(result, indent=2))
    if args.docs:
        command = "python -m bench.preemption " + shlex.join(argv if argv is not None else sys.argv[1:])
        section = (f"{SECTION}\n\n`{command.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
                   f"({platform.machine()}, {os.cpu_count()} cores; 1-minute load average {load:.1f} before the "
                   f"run); see bench/preemption/main.py for what each column measures.\n\n{text}\n")
        write_section(Path(args.docs), SECTION, section, NOTES)
        print(f"section {SECTION[3:]!r} written to {args.docs}")
    return 0
