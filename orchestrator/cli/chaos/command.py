"""`undying chaos`: run a job under random failures and check the invariants; or sweep checkpoint intervals.

    undying chaos JOB.yaml [--mtbf 30s] [--kind kill_rank|kill_node|hang_rank] [--seed 1] [--start 10s]
                  [--max-faults N] [--set k=v ...] [--address ADDR] [--report out.json] [--timeline PNG]
                  [--no-reference] [--fresh]
    undying chaos sweep JOB.yaml --mtbf 60s --intervals 5s,10s,20s,40s,young [--seed 1] --plot sweep.png
                  [--levels storage,two-level] [--step-s S] [--out sweep.json]

`--mtbf` is `chaos.mtbf_s`: the mean time between failures of each target (each rank for the
rank kinds, each node for kill_node), so a 4-rank job with `--mtbf 60s --kind kill_rank` sees
a failure every 15 s on average. The other flags set chaos.mtbf_kind, seed, mtbf_start_s and
mtbf_max_faults; `--set` edits any other field.

Protocol of one experiment (orchestrator.cli.chaos.experiment): unless --no-reference, the same job
with chaos off runs first under the name `<name>.reference` (a finished reference with the same spec
is reused, it is deterministic, when its `reference.json` names these undying and torch releases and
no failure; else it is deleted and run again); then the job runs with its faults; then every invariant check runs
on what it left and the pass/fail table is printed, and the run's timeline PNG is written
(orchestrator.cli.chaos.timeline). A checkpoint root that already holds checkpoints of another run
is refused (a chaos run must start from scratch), unless --fresh, which deletes it first, and only
when an earlier experiment made it (it holds CHAOS_MARKER, which any other run takes away as it
starts: orchestrator.cli.root_lease): a production job's checkpoints are never deleted by pointing
the harness at its spec. Rank PIDs are taken from the ranks' own answers to the
controller's pings (every actor of the run answers one before it trains) by recording them on the
worker group; `run_job` has no hook for it, hence the subclass swapped in for the run. A spec with a
kill_controller fault runs each job in a child process instead, rerun after the controller killed
itself (orchestrator.cli.chaos.child), so the checks see the job's whole life.

Exit codes: 0 the run succeeded and every check passed; 1 the run failed or a check failed;
2 the spec, the flags or the cluster cannot run the experiment (nothing was started).
"""

from __future__ import annotations

import json
import sys

from orchestrator.cli.chaos.harness import Runner, describe_faults, prepare_root, run_with_report, write_json
from orchestrator.cli.chaos.sweep_cmd import sweep_main
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, print_problems
from orchestrator.spec.problems import Problem, SpecError

KINDS = ("kill_rank", "kill_node", "hang_rank")


# The experiment and its runs import torch and Ray; they are imported where used, so that
# `undying chaos --help` (which builds this module's parser) imports neither.


def add_chaos_parser(sub) -> None:
    p = sub.add_parser("chaos", help="run a job under random failures and check the invariants; "
                                     "`chaos sweep` measures goodput per checkpoint interval")
    p.add_argument("words", nargs="+", metavar="[sweep] JOB.yaml", help="job spec YAML, after `sweep` for a sweep")
    p.add_argument("--mtbf", help="chaos.mtbf_s: mean time between failures of each target, e.g. 30s, 5m")
    p.add_argument("--kind", choices=KINDS, help="chaos.mtbf_kind: what fails (default: the spec's; "
                   "if it names none, kill_rank on one node, as on the embedded local Ray, else kill_node)")
    p.add_argument("--seed", type=int, help="chaos.seed: the failure process's seed")
    p.add_argument("--start", help="chaos.mtbf_start_s: no random failure before this many job seconds")
    p.add_argument("--max-faults", type=int, help="chaos.mtbf_max_faults: at most this many random failures")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field, e.g. --set train.steps=200 (repeatable)")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    p.add_argument("--report", help="write the run report with the invariant results (JSON) here")
    p.add_argument("--timeline", help="PNG of the faulty run, every fault, detection and recovery marked "
                   "(default: NAME-chaos-timeline.png in this directory when matplotlib is installed)")
    p.add_argument("--no-reference", action="store_true", help="skip the failure-free run (no model comparison)")
    p.add_argument("--fresh", action="store_true", help="delete the runs' checkpoint roots first")
    p.add_argument("--intervals", help="sweep: checkpoint intervals, e.g. 5s,10s,20s,40s,young")
    p.add_argument("--levels", help="sweep: run each interval at these levels: storage (durable checkpoints only), "
                   "two-level (and the memory level), e.g. storage,two-level (default: the spec's)")
    p.add_argument("--plot", help="sweep: PNG of goodput vs interval (needs matplotlib)")
    p.add_argument("--out", help="sweep: write every run's numbers as JSON here")
    p.add_argument("--step-s", type=float, help="sweep: seconds per step (default: measured by a short run)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def chaos_main(args, runner: Runner | None = None) -> int:
    words = list(args.words)
    sweep = words[0] == "sweep"
    if sweep:
        words = words[1:]
    if len(words) != 1:
        print("undying chaos: give one job spec: `undying chaos JOB.yaml` or `undying chaos sweep JOB.yaml`",
              file=sys.stderr)
        return EXIT_USAGE
    if not sweep and (args.intervals or args.plot or args.out or args.step_s is not None or args.levels):
        print("undying chaos: --intervals, --levels, --plot, --out and --step-s belong to `undying chaos sweep`",
              file=sys.stderr)
        return EXIT_USAGE
    if args.step_s is not None and not args.step_s > 0:
        print(f"undying chaos sweep: --step-s {args.step_s:g}: must be a positive number of seconds (or left out: a "
              "short run measures it)", file=sys.stderr)
        return EXIT_USAGE
    if sweep and (args.timeline or args.report or args.no_reference):
        print("undying chaos: --timeline, --report and --no-reference belong to a single experiment; a sweep "
              "plots with --plot and writes its numbers with --out, and runs no reference", file=sys.stderr)
        return EXIT_USAGE
    try:
        spec = _load(words[0], args)
        from orchestrator.cli.chaos.default_kind import with_default_kind

        spec = with_default_kind(spec, args.address)
        if sweep:
            from orchestrator.cli.chaos.sweep import parse_intervals, parse_levels

            intervals = parse_intervals(args.intervals or "")
            levels = parse_levels(args.levels, spec)
        from orchestrator.cli.extras import plot_problems
        from orchestrator.cli.output_paths import output_problems

        pngs = {"--plot": args.plot} if sweep else {"--timeline": args.timeline}
        if problems := plot_problems(pngs) + output_problems({**pngs, "--out": args.out, "--report": args.report}):
            raise SpecError(problems)
    except SpecError as err:
        print_problems(err.problems)
        return EXIT_USAGE
    if runner is None:
        # A controller that kills itself must not take this process with it: it runs in a child,
        # rerun after each kill (orchestrator.cli.chaos.child).
        from orchestrator.cli.chaos.child import kills_controller, run_rerunning
        from orchestrator.cli.chaos.runs import run_recorded

        runner = run_rerunning if kills_controller(spec) else run_recorded
    if sweep:
        return sweep_main(spec, intervals, levels, args, runner)
    return experiment_main(spec, args, runner)


# (spec field, the flag that sets it, its argparse name): a problem with a flag's value names the flag.
FLAG_FIELDS = (("chaos.mtbf_s", "--mtbf", "mtbf"), ("chaos.mtbf_kind", "--kind", "kind"),
               ("chaos.seed", "--seed", "seed"), ("chaos.mtbf_start_s", "--start", "start"),
               ("chaos.mtbf_max_faults", "--max-faults", "max_faults"))


def _load(path: str, args):
    from chaos.config import support_problems
    from monitor.tracking import tracking_problems
    from orchestrator.cli.chaos import experiment
    from orchestrator.spec.job_spec import load_spec
    from orchestrator.spec.storage_check import require_storage

    overrides = [*args.overrides, *experiment.chaos_overrides(
        mtbf=args.mtbf, kind=args.kind, seed=args.seed, start=args.start, max_faults=args.max_faults)]
    try:
        spec = load_spec(path, overrides)
    except SpecError as err:  # a flag's value is named by its flag, not only by the spec field it sets
        given = {field: flag for field, flag, value in FLAG_FIELDS if getattr(args, value) is not None}
        raise SpecError([Problem(f"{given[p.field]} ({p.field})", p.message) if p.field in given else p
                         for p in err.problems]) from None
    # A tracker's missing package (monitor.tensorboard, monitor.wandb) stops the experiment before its runs.
    problems = [Problem(f, m) for f, m in support_problems(spec.chaos) + tracking_problems(spec.monitor)]
    if spec.chaos.mtbf_s is None and not spec.chaos.faults:
        problems.append(Problem("chaos.mtbf_s", "no fault to inject: give --mtbf 60s (random failures) or "
                                                "chaos.faults in the spec"))
    if spec.parallel.mode == "ps":  # its faults fire through the supervisor's holds, its checks are the collective's
        problems.append(Problem("parallel.mode", "undying chaos runs collective jobs; a parameter-server job "
                                                 "takes its kill_rank, hang_rank, kill_server and hang_server "
                                                 "faults from chaos.faults "
                                                 "under `undying run`"))
    if problems:
        raise SpecError(problems)
    require_storage(spec)
    from orchestrator.spec.data_check import require_data

    require_data(spec)
    return spec


def experiment_main(spec, args, runner: Runner) -> int:
    from orchestrator.cli.chaos import experiment

    reference = None
    try:
        prepare_root(spec, args.fresh)  # before the reference run: a root it refuses wastes none
        if not args.no_reference:
            reference = ensure_reference(spec, runner, args.address, args.fresh)
            if reference is None:
                return EXIT_FAILED
    except SpecError as err:
        print_problems(err.problems)
        return EXIT_USAGE
    from orchestrator.cli.chaos.timeline import timeline_path, write_timeline

    png = timeline_path(spec, args.timeline)
    print(f"undying chaos: {describe_faults(spec)}", flush=True)
    outcome = run_with_report(runner, spec, args.address)
    if outcome.code == EXIT_USAGE:
        return EXIT_USAGE
    if outcome.report is None:
        checks = experiment.failed_run_report(f"the run left no report (exit code {outcome.code})")
    else:
        checks = experiment.invariants(spec, outcome.report, reference=reference,
                                       pids=outcome.pids_to_check(), measured_wall_s=outcome.wall_s,
                                       elsewhere=outcome.elsewhere)
    print("\ninvariants:\n" + checks.table(), flush=True)
    if args.report and outcome.report is not None:
        data = experiment.chaos_report(outcome.report, checks, {
            "faults": describe_faults(spec), "chaos": spec.chaos.model_dump(mode="json"),
            "reference": None if args.no_reference else spec.name + experiment.REFERENCE_SUFFIX,
            "rank_pids": outcome.pids, "measured_wall_s": outcome.wall_s})
        write_json(args.report, data)
        print(f"report written to {args.report}")
    if png and outcome.report is not None:
        write_timeline(outcome.report, png, describe_faults(spec))
    ok = outcome.code == EXIT_OK and checks.ok
    skipped = f" ({len(checks.skipped)} skipped: {', '.join(checks.skipped)})" if checks.skipped else ""
    verdict = ("every check passed" if checks.ok else f"{len(checks.failed)} check(s) FAILED") + skipped
    print(f"undying chaos: run {'succeeded' if outcome.code == EXIT_OK else 'FAILED'}; {verdict}", flush=True)
    return EXIT_OK if ok else EXIT_FAILED


def ensure_reference(spec, runner: Runner, address: str | None, fresh: bool):
    """The failure-free run's final model tensors: reused when a finished reference of the same spec
    exists and `experiment.reference_stale` finds nothing against it, else run now. None (after
    printing why) when the reference run failed."""
    from orchestrator.cli.chaos import experiment
    from orchestrator.spec.job_spec import spec_hash

    ref = experiment.reference_spec(spec)
    catalog = experiment.catalog_of(ref)
    latest = catalog.latest()
    finished = latest == ref.train.steps and catalog.read_manifest(latest).spec_hash == spec_hash(ref)
    stale = experiment.reference_stale(catalog.storage) if finished and not fresh else None
    if finished and not fresh and stale is None:
        print(f"undying chaos: reusing the finished reference run {ref.name!r} ({ref.checkpoint_root})", flush=True)
    else:
        prepare_root(ref, fresh or stale is not None)  # a stale one is an experiment's: deleted, run again
        print(f"undying chaos: reference run {ref.name!r} (chaos off) first"
              + (f"; the finished one is not reused: {stale}" if stale else ""), flush=True)
        outcome = run_with_report(runner, ref, address)
        if outcome.code != EXIT_OK:
            print(f"undying chaos: the reference run failed (exit {outcome.code}); nothing to compare with",
                  file=sys.stderr)
            return None
        record = experiment.reference_record(len(outcome.report.failures) if outcome.report else 0)
        catalog.storage.write_immutable(catalog.storage.path(experiment.REFERENCE_RECORD), json.dumps(record).encode())
    return experiment.final_model(catalog)[1]
