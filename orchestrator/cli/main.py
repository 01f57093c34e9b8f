"""`undying`: the command line. `undying run JOB.yaml` is also the entry point for `ray job submit`.

    undying run JOB.yaml [--set key.path=value ...] [--report PATH] [--timeline PNG] [--address ADDR] [--fresh]
    undying validate JOB.yaml [--set ...]
    undying plan JOB.yaml --gpus N [--gpu h200] [--json]
    undying ckpt ls|verify|export|gc URL [--storage-option KEY=VALUE ...]   (see orchestrator/cli/ckpt_cmd.py)
    undying chaos [sweep] JOB.yaml [--mtbf 30s] [--kind K] [--seed N] ...     (see orchestrator/cli/chaos/command.py)
    undying data prepare INPUT... --tokenizer PATH --out URL [--text-field text] [--address ADDR] ...
                                                                             (see orchestrator/cli/data/command.py)
    undying eval CKPT_URL --data URL [--step N] [--windows K] [--seq-len T] [--json]  (see orchestrator/cli/eval_cmd.py)

Exit codes: 0 the job succeeded; 1 the job failed (its checkpoints are intact); 2 the
spec or the cluster cannot run the job as written (nothing was started). User mistakes
print one line per problem, naming the field and the fix, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from orchestrator.cli.chaos.command import add_chaos_parser
from orchestrator.cli.ckpt_cmd import add_ckpt_parser
from orchestrator.cli.data.command import add_data_parser
from orchestrator.cli.eval_cmd import add_eval_parser
from orchestrator.cli.exits import EXIT_OK, EXIT_USAGE, print_problems
from orchestrator.spec.job_spec import JobSpec, Problem, SpecError, load_spec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="undying", description="Fault-tolerant training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a training job")
    validate = sub.add_parser("validate", help="check a job spec without starting anything")
    plan = sub.add_parser("plan", help="rank parallel layouts for N devices by predicted step time and memory")
    for p in (run, validate, plan):
        p.add_argument("spec", help="job spec YAML")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec field, e.g. --set parallel.dp=4 (repeatable)")
    run.add_argument("--report", help="write the JSON run report to this path")
    run.add_argument("--timeline", help="write a PNG timeline (needs matplotlib)")
    run.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else embedded local Ray)")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="number of devices to plan for")
    plan.add_argument("--gpu", default="h100", choices=("h100", "h200", "a100", "cpu"),
                      help="device kind (default h100; cpu measures this machine)")
    plan.add_argument("--json", dest="as_json", action="store_true", help="print the whole plan as JSON")
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    run.add_argument("--fresh", action="store_true",
                     help="start from step 0 where the checkpoints were all quarantined as corrupt (refused while "
                          "committed checkpoints exist; nothing is ever deleted)")
    add_ckpt_parser(sub)
    add_chaos_parser(sub)
    add_data_parser(sub)
    add_eval_parser(sub)
    return parser


def _load(args) -> JobSpec:
    from chaos.config import support_problems
    from orchestrator.spec.data_check import require_data
    from orchestrator.spec.storage_check import require_storage

    spec = load_spec(args.spec, args.overrides)
    problems = [Problem(field, message) for field, message in support_problems(spec.chaos)]
    if problems:
        raise SpecError(problems)
    require_storage(spec)
    require_data(spec)
    return spec


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "ckpt":  # works on a checkpoint root; no spec involved
        from orchestrator.cli.ckpt_cmd import ckpt_main

        return ckpt_main(args)
    if args.command == "eval":  # works on a checkpoint root and a prepared dataset; no spec involved
        from orchestrator.cli.eval_cmd import eval_main

        return eval_main(args)
    if args.command == "data":  # works on data files and a tokenizer; no spec involved
        from orchestrator.cli.data.command import data_main

        return data_main(args)
    if args.command == "chaos":  # its own spec handling: reference run, overrides from its flags
        from orchestrator.cli.chaos.command import chaos_main

        return chaos_main(args)
    if args.command == "plan":  # planning needs no storage: only the spec is checked
        from orchestrator.cli.plan_cmd import plan_main

        try:
            spec = load_spec(args.spec, args.overrides)
        except SpecError as err:
            print_problems(err.problems)
            return EXIT_USAGE
        return plan_main(spec, args.gpus, args.gpu, args.as_json)
    try:
        spec = _load(args)
    except SpecError as err:
        print_problems(err.problems)
        return EXIT_USAGE
    if args.command == "validate":
        print(f"{args.spec}: valid ({spec.world_size} ranks, {spec.train.steps} steps)")
        return EXIT_OK
    if args.fresh:
        from orchestrator.controller.restore_policy import fresh_problem

        problem = fresh_problem(spec)
        if problem is not None:
            print_problems([Problem("--fresh", problem)])
            return EXIT_USAGE
    from orchestrator.cli.run import run_job

    return run_job(spec, address=args.address, report_path=args.report, timeline_path=args.timeline,
                   fresh=args.fresh)


if __name__ == "__main__":
    sys.exit(main())
