"""`undying`: the command line. `undying run JOB.yaml` is also the entry point for `ray job submit`.

    undying run JOB.yaml [--set key.path=value ...] [--report PATH] [--timeline PNG] [--address ADDR] [--fresh]
    undying validate JOB.yaml [--set ...] [--offline] [--json]
    undying plan JOB.yaml --gpus N [--gpu h200] [--json]
    undying spec --schema | --markdown                                   (see orchestrator/cli/spec_cmd.py)
    undying ckpt ls|verify|export|gc URL [--storage-option KEY=VALUE ...] [--json] (see orchestrator/cli/ckpt_cmd.py)
    undying chaos [sweep] JOB.yaml [--mtbf 30s] [--kind K] [--seed N] ...     (see orchestrator/cli/chaos/command.py)
    undying data prepare INPUT... --tokenizer PATH --out URL [--text-field text] [--address ADDR] ...
                                                                             (see orchestrator/cli/data/command.py)
    undying eval CKPT_URL --data URL [--step N] [--windows K] [--seq-len T] [--json]  (see orchestrator/cli/eval_cmd.py)
    undying report CKPT_URL [--run RUN] [--timeline PNG] [--out JSON] [--json]    (see orchestrator/cli/report_cmd.py)
    undying stop-jobs [--address URL] [--wait S]           (a head pod's preStop: orchestrator/cli/stop_jobs.py)
    undying drain-node [--node-id HEX] [--wait S]       (a worker pod's preStop: orchestrator/cli/drain_node.py)
    undying spot-watch [--cloud aws|gcp] [--poll S] [--margin S] [--metadata URL] [--address ADDR]
                                                        (on each spot VM worker: orchestrator/cli/spot_watch.py)
    undying --version

Exit codes: 0 the job succeeded; 1 the job failed (its checkpoints are intact); 2 the
spec or the cluster cannot run the job as written (nothing was started); 75 the job was
stopped by SIGTERM or SIGINT (a rerun resumes where it checkpointed); 130 Ctrl-C stopped a
command that does not take signals itself (orchestrator.cli.exits). User mistakes print one line
per problem, naming the field and the fix, never a traceback.

`undying --help` and `undying CMD --help` import no engine (torch, Ray): the commands whose
options live in their own module are registered lazily (`LazyParser`), their module imported
only when the command is the one given.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from orchestrator.cli.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, print_problems
from orchestrator.cluster.address import RayAddressError

# Commands defined in their own modules, each with its own spec handling or none (they work on a
# checkpoint root, a dataset...): name -> (help, module, parser function, main function).
LAZY_COMMANDS = {
    "spec": ("print the job spec's JSON Schema or its field reference (docs/spec.md)",
             "orchestrator.cli.spec_cmd", "add_spec_parser", "spec_main"),
    "ckpt": ("list, verify, export and garbage-collect a job's checkpoints",
             "orchestrator.cli.ckpt_cmd", "add_ckpt_parser", "ckpt_main"),
    "chaos": ("run a job under random failures and check the invariants; `chaos sweep` measures goodput per "
              "checkpoint interval", "orchestrator.cli.chaos.command", "add_chaos_parser", "chaos_main"),
    "data": ("prepare tokenized training data", "orchestrator.cli.data.command", "add_data_parser", "data_main"),
    "eval": ("validation loss of a committed checkpoint on a prepared dataset",
             "orchestrator.cli.eval_cmd", "add_eval_parser", "eval_main"),
    "report": ("rebuild a run's summary table and timeline PNG from the event log under its checkpoint root",
               "orchestrator.cli.report_cmd", "add_report_parser", "report_main"),
    "stop-jobs": ("SIGTERM this Ray cluster's job drivers and wait for them to end (a head pod's preStop hook)",
                  "orchestrator.cli.stop_jobs", "add_stop_jobs_parser", "stop_jobs_main"),
    "drain-node": ("drain this Ray node for preemption and wait until its ranks have moved off (a worker pod's "
                   "preStop hook)", "orchestrator.cli.drain_node", "add_drain_node_parser", "drain_node_main"),
    "spot-watch": ("watch this VM's metadata for a spot preemption notice and drain this Ray node by its deadline",
                   "orchestrator.cli.spot_watch", "add_spot_watch_parser", "spot_watch_main"),
}
SET_HELP = ("override a spec field, e.g. --set parallel.dp=4 (repeatable); quote a key part holding other "
            "characters than letters, digits, _ and -: --set 'checkpoint.storage_options.\"client_kwargs:x\"=1'")


class LazyParser(argparse.ArgumentParser):
    """A subcommand's parser whose arguments are added on first use: `define(self)` runs just
    before it parses, so a command's module is imported only when that command is given.
    `argparse` calls `parse_known_args` on the chosen subcommand's parser only."""

    define = None

    def __init__(self, *args, **kwargs):
        # No prefixes of long options: `ckpt gc --f` is not --force, `--storage-options` (a typo) not
        # --storage-options-file. Nested subcommands' parsers (ckpt ls, data prepare) are of this class.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if self.define is not None:
            define, self.define = self.define, None
            define(self)
        return super().parse_known_args(args, namespace)


class _Into:
    """Stands in for the subparsers action an `add_X_parser(sub)` function expects: its one
    `add_parser` call returns the lazy parser already registered under that name."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        if kwargs.get("description"):
            self.parser.description = kwargs["description"]
        return self.parser


def _define(module: str, function: str):
    return lambda parser: getattr(importlib.import_module(module), function)(_Into(parser))


def _version() -> str:
    try:
        return version("undying")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed; pip install -e .)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="undying", description="Fault-tolerant training on Ray.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"undying {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LazyParser)
    run = sub.add_parser("run", help="run (or resume) a training job")
    validate = sub.add_parser("validate", help="check a job spec without starting anything")
    plan = sub.add_parser("plan", help="rank parallel layouts for N devices by predicted step time and memory")
    for p in (run, validate, plan):
        p.add_argument("spec", help="job spec YAML")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    run.add_argument("--report", help="write the JSON run report to this path")
    run.add_argument("--timeline", help="write a PNG timeline (needs matplotlib)")
    run.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    validate.add_argument("--offline", action="store_true", help="do not probe the checkpoint storage or read the "
                          "datasets and model.from_hf's weights (for CI, or without network); model.from_hf's "
                          "config.json is still read, since the model's architecture comes from it")
    validate.add_argument("--json", dest="as_json", action="store_true", help="print the result as one JSON object")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="number of devices to plan for")
    plan.add_argument("--gpu", default="h100", choices=("h100", "h200", "a100", "cpu"),
                      help="device kind (default h100; cpu measures this machine)")
    plan.add_argument("--json", dest="as_json", action="store_true", help="print the whole plan as JSON")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    run.add_argument("--fresh", action="store_true",
                     help="start from step 0 where the checkpoints were all quarantined as corrupt (refused while "
                          "committed checkpoints exist; nothing is ever deleted)")
    for name, (text, module, function, _) in LAZY_COMMANDS.items():
        sub.add_parser(name, help=text).define = _define(module, function)
    return parser


def _load(args, probe: bool = True):
    """The checked JobSpec and the notes to print about it; with `probe`, the checkpoint storage and the
    datasets are reached too (and the notes say how many epochs of each dataset the run reads)."""
    from chaos.config import support_problems
    from monitor.tracking import tracking_problems
    from orchestrator.spec.elastic import shrink_notes
    from orchestrator.spec.job_spec import Problem, SpecError, load_spec
    from orchestrator.spec.storage_check import unshared_url_problems

    spec = load_spec(args.spec, args.overrides)
    # A tracker's missing package is found here, before the run starts, not at its end.
    found = support_problems(spec.chaos) + tracking_problems(spec.monitor)
    problems = [Problem(field, message) for field, message in found] + unshared_url_problems(spec.checkpoint.url)
    if problems:
        raise SpecError(problems)
    if probe:
        from orchestrator.spec.data_check import require_data
        from orchestrator.spec.storage_check import require_storage

        require_storage(spec)
        return spec, cadence_notes(spec) + shrink_notes(spec) + require_data(spec)
    return spec, cadence_notes(spec) + shrink_notes(spec)


def cadence_notes(spec) -> list[str]:
    """What a reader may misread in a valid spec: a bare-number checkpoint.interval counts seconds,
    where TorchTitan's checkpoint.interval counts steps."""
    interval = spec.checkpoint.interval
    if spec.checkpoint.rule != "seconds" or isinstance(interval, str) or spec.checkpoint.every_seconds:
        return []
    if not math.isfinite(interval) or interval != int(interval):  # no step count was meant
        return [f"checkpoint.interval: {interval:g} counts seconds (a save about every {interval:g} s)"]
    return [f"checkpoint.interval: {interval:g} counts seconds (a save about every {interval:g} s); to save every "
            f"{interval:g} steps, as TorchTitan's checkpoint.interval does, write `interval: {interval:g} steps` "
            f"or `every_steps: {interval:g}`"]


def _validate(args) -> int:
    from orchestrator.spec.job_spec import SpecError

    try:
        spec, notes = _load(args, probe=not args.offline)
    except SpecError as err:
        if args.as_json:
            print(json.dumps({"spec": args.spec, "valid": False,
                              "problems": [{"field": p.field, "message": p.message} for p in err.problems]}))
        else:
            print_problems(err.problems)
        return EXIT_USAGE
    probed = "skipped (--offline)" if args.offline else "ok"
    if args.as_json:
        print(json.dumps({"spec": args.spec, "valid": True, "name": spec.name, "ranks": spec.world_size,
                          "steps": spec.train.steps, "checkpoint_root": spec.checkpoint_root,
                          "storage_probe": probed, "data_probe": probed, "notes": notes}))
        return EXIT_OK
    print(f"{args.spec}: valid ({spec.world_size} ranks, {spec.train.steps} steps)")
    if args.offline:
        print(f"offline: {spec.checkpoint_root} and the datasets were not probed (--offline); `undying validate` "
              "without it checks that they can be reached")
    for note in notes:
        print(f"note: {note}")
    return EXIT_OK


def _run(args) -> int:
    from orchestrator.cli.extras import plot_problems
    from orchestrator.cli.output_paths import output_problems
    from orchestrator.spec.job_spec import Problem, SpecError

    try:
        spec, notes = _load(args)
    except SpecError as err:
        print_problems(err.problems)
        return EXIT_USAGE
    outputs = {"--report": args.report, "--timeline": args.timeline}
    if problems := plot_problems({"--timeline": args.timeline}) + output_problems(outputs):  # before Ray
        print_problems(problems)
        return EXIT_USAGE
    for note in notes:
        print(f"undying: note: {note}", file=sys.stderr)
    if args.fresh:
        from orchestrator.controller.restore_policy import fresh_problem

        problem = fresh_problem(spec)
        if problem is not None:
            print_problems([Problem("--fresh", problem)])
            return EXIT_USAGE
    if spec.parallel.mode == "ps":
        from orchestrator.cli.ps_run import run_ps_job

        return run_ps_job(spec, address=args.address, report_path=args.report, timeline_path=args.timeline,
                          fresh=args.fresh)
    from orchestrator.cli.run import run_job

    return run_job(spec, address=args.address, report_path=args.report, timeline_path=args.timeline,
                   fresh=args.fresh)


def _plan(args) -> int:
    from orchestrator.cli.plan_cmd import plan_main
    from orchestrator.spec.job_spec import SpecError, load_spec

    try:  # planning needs no storage: only the spec is checked
        spec = load_spec(args.spec, args.overrides)
    except SpecError as err:
        if not args.as_json:
            print_problems(err.problems)
        else:  # as `validate --json` lists them, with the failure's error and exit as `fail_line` gives
            print(json.dumps({"error": f"the job cannot run as written ({len(err.problems)} problem(s))",
                              "exit": EXIT_USAGE, "problems": [{"field": p.field, "message": p.message}
                                                               for p in err.problems]}))
        return EXIT_USAGE
    return plan_main(spec, args.gpus, args.gpu, args.as_json)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in LAZY_COMMANDS:
            _, module, _, function = LAZY_COMMANDS[args.command]
            return getattr(importlib.import_module(module), function)(args)
        return {"validate": _validate, "run": _run, "plan": _plan}[args.command](args)
    except RayAddressError as err:  # before any work: one line, the fix in it
        print(f"undying {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader of our output went away (`undying ckpt verify URL | head -1`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot raise again
        return EXIT_FAILED
    except KeyboardInterrupt:  # what each command holds (a lease, a temp file) it let go on the way out
        action = getattr(args, f"{args.command}_command", None)  # `ckpt gc`: the subcommand too
        print(f"undying {args.command}{f' {action}' if action else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
