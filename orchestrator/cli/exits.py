"""Exit codes of every `undying` command and how user mistakes are printed.

    0 (EXIT_OK)      the job or command succeeded
    1 (EXIT_FAILED)  the job failed; its committed checkpoints are intact
    2 (EXIT_USAGE)   the spec or the cluster cannot run the job as written; nothing was started
    75 (EXIT_PREEMPTED)  the job was stopped by SIGTERM or SIGINT (EX_TEMPFAIL: retry it); it
                     checkpointed where it stopped when it could, and a rerun resumes there
    130 (EXIT_INTERRUPTED)  Ctrl-C stopped a command that does not take signals itself (`ckpt gc`
                     watching a job's heartbeat, `ckpt verify` reading; `run` before Ray is up)

Every command module prints user mistakes with `print_problems` and returns EXIT_USAGE:
one line per problem, naming the field and the fix, never a traceback.
"""

from __future__ import annotations

import errno
import json
import socket
import sys

from orchestrator.spec.problems import Problem

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: schedulers and wrappers read it as "try again"
EXIT_INTERRUPTED = 130  # the shell's own code for a process ended by SIGINT


def print_problems(problems: list[Problem]) -> None:
    """One line per user mistake on stderr (the caller then exits 2)."""
    print(f"undying: the job cannot run as written ({len(problems)} problem(s)):", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)


def fail_line(as_json: bool, message: str, code: int) -> int:
    """The one line of a failed command (returns `code`): on stderr, or under --json as one JSON
    object on stdout, `{"error": message, "exit": code}`, so a script's json.loads never meets prose."""
    if as_json:
        print(json.dumps({"error": message, "exit": code}))
    else:
        print(message, file=sys.stderr)
    return code


class UsageError(Exception):
    """The arguments cannot work as given; the message names the argument and the fix."""


def serve_metrics(metrics, spec) -> int | None:
    """Start the job's metrics endpoint on `monitor.host:monitor.port`; its port, or None (printed,
    the caller exits 2) when the address cannot be bound: a port another job or exporter holds, or a
    host that does not resolve or is not this machine's."""
    host, port = spec.monitor.host, spec.monitor.port
    try:
        return metrics.serve(host, port)
    except OSError as err:
        reason = err.strerror or str(err)
        if isinstance(err, socket.gaierror):  # a name no resolver knows
            problem = Problem("monitor.host", f"{host!r} does not resolve ({reason}); give an address of this "
                                              "machine, e.g. 0.0.0.0 (all interfaces) or 127.0.0.1")
        elif err.errno == errno.EADDRNOTAVAIL:
            problem = Problem("monitor.host", f"{host} is not an address of this machine ({reason}); give one of "
                                              "its own, e.g. 0.0.0.0 (all interfaces) or 127.0.0.1")
        else:
            problem = Problem("monitor.port", f"cannot serve the metrics on {host}:{port} ({reason}); give a free "
                                              "port, or 0 for any")
        print_problems([problem])
        return None
