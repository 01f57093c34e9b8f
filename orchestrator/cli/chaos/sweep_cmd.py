"""`undying chaos sweep`: calibrate the step time, run the job once per interval and level under the
same failures, fit the model, print the table, write the JSON and the plot (orchestrator.cli.chaos.sweep
has the protocol and the pure parts). Called by orchestrator.cli.chaos.command.chaos_main.
"""

from __future__ import annotations

import shlex
import sys

from orchestrator.cli.chaos.harness import Runner, describe_faults, prepare_root, run_with_report, write_json
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, print_problems
from orchestrator.spec.problems import SpecError


def sweep_main(spec, intervals, levels, args, runner: Runner) -> int:
    """Calibrate the step time, run the job once per interval and level under the same failures, fit the
    model, print the table, write the JSON and the plot (orchestrator.cli.chaos.sweep has the protocol)."""
    from orchestrator.cli.chaos import sweep
    from orchestrator.cli.chaos.goodput_model import inputs_from_reports

    try:
        mtbf = sweep.system_mtbf_s(spec)
        # Every run's spec and root, before any run: a root refused after the first runs took their
        # minutes would end the sweep with its work thrown away (a root's name is not the step time's).
        grid = [sweep.sweep_spec(spec, i, args.step_s or 1.0, level) for i in intervals for level in levels]
        calibration = [sweep.calibration_spec(spec)] if args.step_s is None else []
        for run_spec in calibration + grid:
            prepare_root(run_spec, args.fresh)
    except SpecError as err:
        print_problems(err.problems)
        return EXIT_USAGE
    step_s = args.step_s if args.step_s is not None else _calibrate(calibration[0], args, runner)
    if isinstance(step_s, int):
        return step_s  # the calibration's exit code
    print(f"undying chaos sweep: {describe_faults(spec)}; system MTBF {mtbf:.1f} s; step {step_s:.3f} s", flush=True)
    grid = _run_grid(spec, intervals, levels, step_s, args, runner)
    if isinstance(grid, int):
        return grid
    rows, reports = grid
    # The model is of one level: C and R come from the storage-only runs when there are any.
    storage = [rep for rep, row in zip(reports, rows, strict=True) if row.level == "storage"]
    try:
        inputs = inputs_from_reports(storage or reports, mtbf)
    except ValueError as err:  # no run committed a save: C is unknown
        print(f"undying chaos sweep: {err}; give the job more train.steps or shorter --intervals", file=sys.stderr)
        return EXIT_FAILED
    result = sweep.summary(rows, inputs)
    _print_summary(rows, inputs, result, mtbf)
    if args.out:
        write_json(args.out, {"command": shlex.join(["undying", *sys.argv[1:]]), "step_s": step_s,
                              "system_mtbf_s": mtbf, "chaos": spec.chaos.model_dump(mode="json"),
                              "rows": sweep.rows_to_json(rows), "summary": result, "reports": reports})
        print(f"sweep written to {args.out}")
    if args.plot:
        from orchestrator.cli.chaos.sweep_plot import plot_sweep

        plot_sweep(rows, inputs, args.plot, title=f"{spec.name}: {describe_faults(spec)}")
        print(f"plot written to {args.plot}")
    return EXIT_OK if all(r.status == "succeeded" for r in rows) else EXIT_FAILED


def _calibrate(spec, args, runner: Runner) -> float | int:
    """The step time a short failure-free run of `spec` measures; else the exit code, the reason printed."""
    from orchestrator.cli.chaos import sweep

    outcome = run_with_report(runner, spec, args.address)
    if outcome.code != EXIT_OK or outcome.report is None:
        print(f"undying chaos sweep: the calibration run failed (exit {outcome.code})", file=sys.stderr)
        return EXIT_FAILED
    try:
        return sweep.step_seconds(outcome.report)
    except ValueError as err:
        print(f"undying chaos sweep: {err}; give the job more train.steps, or --step-s", file=sys.stderr)
        return EXIT_USAGE


def _print_summary(rows, inputs, result: dict, mtbf: float) -> None:
    from orchestrator.cli.chaos import sweep

    print("\n" + sweep.table(rows, inputs) + "\n", flush=True)
    best = result["best_fixed"]
    print(f"tau* = sqrt(2 C M) = {inputs.tau_star:.1f} s (C {inputs.cost_s:.3f} s over {inputs.saves} saves, "
          f"M {mtbf:.1f} s; R {inputs.restart_s:.1f} s over {inputs.restarts} recoveries)"
          + (f"; best fixed interval {best['label']} ({100 * best['steady_goodput']:.1f}% steady goodput)"
             if best else ""), flush=True)
    for rule in sweep.RULES:
        if rule in result:
            print(f"{rule}: {sweep.against_best(result[rule]['points_below_best'])} the best fixed interval")
    print("(one run per interval: where each kill lands moves a row by a few points; rows closer than that are "
          "not ranked by one sweep: run it again with other --seed values)", flush=True)
    for label, gain in result["two_level_vs_storage"].items():
        print(f"interval {label}: two-level {gain['goodput_points']:+.1f} points of goodput, its wall "
              f"{gain['wall_change']:+.1%} for the same steps, against storage only")


def _run_grid(spec, intervals, levels, step_s: float, args, runner: Runner):
    """Each interval at each level, in order: (rows, reports), or the exit code that ended the sweep."""
    from orchestrator.cli.chaos import sweep

    rows, reports = [], []
    for interval, level in [(i, level) for i in intervals for level in levels]:
        run_spec = sweep.sweep_spec(spec, interval, step_s, level)  # its root prepared before any run
        print(f"undying chaos sweep: interval {interval.label}, {level} ({run_spec.name})", flush=True)
        outcome = run_with_report(runner, run_spec, args.address)
        if outcome.report is None:
            print(f"undying chaos sweep: run {run_spec.name} left no report (exit {outcome.code})", file=sys.stderr)
            return EXIT_FAILED
        reports.append(outcome.report.model_dump(mode="json"))
        rows.append(sweep.measure(interval.label, interval.seconds, run_spec.checkpoint.every_steps, outcome.report,
                                  level))
    return rows, reports
