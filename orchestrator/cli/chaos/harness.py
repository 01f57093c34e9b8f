"""What every `undying chaos` command shares (orchestrator.cli.chaos.command, orchestrator.cli.chaos.sweep_cmd):
a run's checkpoint root made ready (`prepare_root`: refused, or deleted with --fresh when an earlier
experiment made it, then marked), a run with its report (`run_with_report`), the faults in words,
a JSON file written.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.spec.problems import Problem, SpecError

if TYPE_CHECKING:
    from orchestrator.cli.chaos.runs import RunOutcome

Runner = Callable[..., "RunOutcome"]  # runner(spec, address=..., report_path=...) -> RunOutcome


def describe_faults(spec) -> str:
    chaos = spec.chaos
    parts = [f"{len(chaos.faults)} scripted fault(s)"] if chaos.faults else []
    if chaos.mtbf_s is not None:
        targets = f"each of {spec.world_size} ranks" if chaos.mtbf_kind != "kill_node" else "each node"
        parts.append(f"random {chaos.mtbf_kind} with MTBF {chaos.mtbf_s:g} s for {targets} (seed {chaos.seed}"
                     + (f", from {chaos.mtbf_start_s:g} s" if chaos.mtbf_start_s else "")
                     + (f", at most {chaos.mtbf_max_faults}" if chaos.mtbf_max_faults else "") + ")")
    return "; ".join(parts) or "no faults"


def prepare_root(spec, fresh: bool) -> None:
    """A chaos run starts from scratch: refuse a root that holds checkpoints, or delete it with --fresh
    when an earlier experiment made it (CHAOS_MARKER); then mark it as this experiment's."""
    from ckpt.owner_claims import UnreadableClaim, live_owner
    from ckpt.ownership import OwnerAlive, refuse_a_beating_owner
    from orchestrator.cli.chaos import experiment
    from orchestrator.cli.root_lease import CHAOS_MARKER
    from orchestrator.controller.kill import MARKER_DIR
    from orchestrator.controller.ledger_snapshot import SNAPSHOT_FILE

    catalog = experiment.catalog_of(spec)
    storage = catalog.storage
    # A kill_controller marker alone (the controller died before its first commit) is state too:
    # it would keep that fault from firing in this run; and so is a goodput snapshot alone (a run
    # killed before its first commit), whose seconds a fresh start carries as the job's.
    if catalog.all_steps() or any(storage.exists(storage.path(name)) for name in (MARKER_DIR, SNAPSHOT_FILE)):
        ours = storage.exists(storage.path(CHAOS_MARKER))
        if not fresh:  # --fresh is offered only where it would act: the roots an experiment made
            raise SpecError([Problem("checkpoint.url", f"{spec.checkpoint_root} already holds checkpoints (or chaos "
                                     "records) of an earlier run, which this run would resume from; "
                                     + ("pass --fresh to delete them, or " if ours else "")
                                     + "choose another name with --set name=...")])
        if not ours:
            raise SpecError([Problem("checkpoint.url", f"{spec.checkpoint_root} holds checkpoints that no `undying "
                                     f"chaos` experiment made (it has no {CHAOS_MARKER}), so --fresh leaves them: "
                                     "choose another name with --set name=..., or delete them yourself if they "
                                     "should go")])
        try:
            owner = live_owner(storage)
            if owner is None:  # a holder stale by two hosts' clocks is alive while its beat advances
                refuse_a_beating_owner(storage)
        except UnreadableClaim as err:  # who holds it is unknown
            owner = f"unknown, since {err}"
        except OwnerAlive as err:
            owner = str(err)
        if owner is not None:
            raise SpecError([Problem("checkpoint.url", f"{spec.checkpoint_root} belongs to a running job: {owner}; "
                                     "--fresh deletes nothing while it runs: stop it, or choose another name with "
                                     "--set name=...")])
        storage.remove_tree(storage.root)
    # Marked only where nothing else is: a job's root that holds no checkpoint yet (its lease, its
    # event log) marked here would later be deleted by --fresh once it holds some.
    others = [name for name in storage.listdir(storage.root) if name != CHAOS_MARKER]
    if others and not storage.exists(storage.path(CHAOS_MARKER)):
        raise SpecError([Problem("checkpoint.url", f"{spec.checkpoint_root} holds {', '.join(others[:3])} of a job "
                                 "that no `undying chaos` experiment made; choose another name with --set name=...")])
    with storage.atomic_writer(storage.path(CHAOS_MARKER)) as out:
        out.write(json.dumps({"job": spec.name}).encode())


def run_with_report(runner: Runner, spec, address: str | None) -> RunOutcome:
    with tempfile.TemporaryDirectory(prefix="undying-chaos-") as tmp:
        return runner(spec, address=address, report_path=os.path.join(tmp, "report.json"))


def write_json(path: str, data) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2))
