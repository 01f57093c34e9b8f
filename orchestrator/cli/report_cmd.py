"""`undying report CKPT_URL`: a run's summary table and timeline PNG, rebuilt from its event log.

    undying report CKPT_URL [--run RUN] [--timeline PNG | --no-timeline] [--out JSON] [--json]
                   [--storage-option KEY=VALUE ...] [--storage-options-file PATH]

CKPT_URL is the job's checkpoint root (`<checkpoint.url>/<job name>`), where every run of the
controller logs its events (monitor.event_log: `events/<run>/`), so the report of a run can be
rebuilt on any machine after the pod that ran it is gone. The newest run by default; `--run`
names another (the JSON output lists them). A run whose log has no end (its controller died, or
it still runs) reports status `unfinished`, up to its last flushed event.

Exit codes: 0 printed; 1 the store failed; 2 the arguments cannot work (no log there, no such run,
a PNG asked for without matplotlib). Under --json, one JSON object on stdout, errors too
({"error": ..., "exit": N}).
"""

from __future__ import annotations

import argparse
import json

from orchestrator.cli.ckpt_catalog import error_reason, is_storage_error, open_catalog
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError, fail_line
from orchestrator.cli.extras import PLOT_EXTRA, PLOT_MODULE, install_hint, installed
from orchestrator.cli.output_paths import output_problems
from orchestrator.cli.storage_args import add_storage_option_args, parse_storage_options

HELP = "rebuild a run's summary table and timeline PNG from the event log under its checkpoint root"


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help=HELP, description=HELP)
    p.add_argument("url", metavar="CKPT_URL", help="the job's checkpoint root: <checkpoint.url>/<job name>")
    p.add_argument("--run", help="which run of the controller (default: the newest; --json lists them)")
    p.add_argument("--timeline", metavar="PNG", help="where to write the timeline PNG (default: "
                   "<job>-timeline.png here, skipped with a note when matplotlib is missing)")
    p.add_argument("--no-timeline", action="store_true", help="write no PNG")
    p.add_argument("--out", metavar="JSON", help="also write the rebuilt report as JSON to this path")
    p.add_argument("--json", dest="as_json", action="store_true",
                   help="print one JSON object on stdout (errors too: {\"error\": ..., \"exit\": N})")
    add_storage_option_args(p, "fsspec storage option for CKPT_URL, e.g. endpoint_url=http://host:8333 (repeatable)")


def _rebuild(args: argparse.Namespace):
    from monitor.event_log import list_runs, read_run
    from monitor.events import report_from_events

    storage = open_catalog(args.url, parse_storage_options(args.storage_options, args.storage_options_file)).storage
    try:
        runs = list_runs(storage)
    except NotADirectoryError:
        raise UsageError(f"URL {storage.url} is a file; give the job's checkpoint root, <checkpoint.url>/<job "
                         "name>") from None
    if not runs:
        raise UsageError(_no_event_log(storage))
    run = args.run or runs[-1]
    if run not in runs:
        raise UsageError(f"--run {run}: no such run under {storage.url}; it has {', '.join(runs)}")
    events = read_run(storage, run)
    try:
        report = report_from_events(events)
    except ValueError as err:
        raise UsageError(f"--run {run}: {err}") from None
    return report, run, runs, len(events)


def _no_event_log(storage) -> str:
    """Why the URL has no event log, naming the fix: it does not exist, it is checkpoint.url itself (its
    job folders hold the logs), or it is a folder of a job an older release ran."""
    from monitor.event_log import EVENTS_DIR

    if not storage.exists(storage.root):
        return f"URL {storage.url} does not exist; give the job's checkpoint root, <checkpoint.url>/<job name>"
    jobs = [name for name in storage.listdir(storage.root)[:20] if EVENTS_DIR in storage.listdir(storage.path(name))]
    if jobs:
        return f"URL {storage.url} holds job folders, not one job's log; give one of them, e.g. {storage.url}/{jobs[0]}"
    return (f"URL {storage.url} has no event log ({EVENTS_DIR}/); give the job's checkpoint root, <checkpoint.url>/"
            "<job name>, of a job run by this release")


def _timeline_path(args: argparse.Namespace, job: str) -> tuple[str | None, str | None]:
    """(where to write the PNG or None, a note to print when it is skipped)."""
    if args.no_timeline:
        return None, None
    if not installed(PLOT_MODULE):
        if args.timeline:
            raise UsageError(f"--timeline needs matplotlib: {install_hint(PLOT_EXTRA)}, or leave --timeline out")
        return None, f"no timeline PNG: matplotlib is not installed ({install_hint(PLOT_EXTRA)})"
    return args.timeline or f"{job}-timeline.png", None


def report_main(args: argparse.Namespace) -> int:
    try:
        if args.no_timeline and args.timeline:
            raise UsageError("--timeline and --no-timeline: give one")
        report, run, runs, count = _rebuild(args)
        png, note = _timeline_path(args, report.job)
        problems = output_problems({"--timeline": png, "--out": args.out})
        if problems:
            raise UsageError("; ".join(str(problem) for problem in problems))
    except UsageError as err:
        return fail_line(args.as_json, f"undying report: {err}", EXIT_USAGE)
    except Exception as err:
        if not is_storage_error(err):
            raise
        return fail_line(args.as_json, f"undying report: storage error: {error_reason(err)}", EXIT_FAILED)
    if png:
        from monitor.timeline import plot_timeline

        plot_timeline(report, png)
    if args.out:
        report.to_json(args.out)
    if args.as_json:
        print(json.dumps({"url": args.url, "run": run, "runs": runs, "events": count, "timeline": png,
                          "out": args.out, "report": json.loads(report.model_dump_json())}))
        return EXIT_OK
    print(f"run {run} of {args.url}: {count} events")
    print(report.summary_table())
    for line in ([f"timeline written to {png}"] if png else []) + ([note] if note else []):
        print(line)
    if args.out:
        print(f"report written to {args.out}")
    return EXIT_OK
