"""A chaos experiment: one job run under faults, then the invariant checks on what it left.

Protocol (orchestrator.cli.chaos.command drives it; nothing here starts Ray or a rank):
  1. `chaos_overrides(...)` turns the command's flags into `--set` overrides of the `chaos:`
     section (random failures: chaos.mtbf_s and its companions), applied after the user's.
  2. `reference_spec(spec)` is the same job with chaos off, under another name, so its
     checkpoints land under another prefix (`<checkpoint.url>/<name>.reference`). Its final
     model is what the faulty run must reproduce (docs/design.md section 7).
  3. The caller runs both jobs, then `invariants(...)` gathers every check's inputs from the
     faulty run's report and checkpoints and runs orchestrator.cli.chaos.invariants.check_all: checkpoints
     verify and the newest loads; the final state's tensors, the model's `model/...` and the
     optimizer's `optim/...`, equal the reference's (bit for bit when the run never changed dp,
     else within rtol 1e-5, atol 1e-6 at each tensor's scale); every step and sample survives
     exactly once (RunReport.history, with the ranks' sample digests); the goodput buckets sum to
     wall; no rank process is left; and the faults scheduled fired (a run none reached tested
     nothing, and its other checks pass trivially; a corrupt_shard not applied, or whose step
     retention deleted unread, did not fire; the report's `faults_skipped` are counted in its words).
  4. `chaos_report(...)` is the JSON written by `--report`: the RunReport's fields plus
     `invariants` (InvariantReport.to_dict) and `experiment` (what was injected, compared).

`with_changes` derives specs by editing the validated spec's plain data and validating it
again, so a derived spec is exactly as checked as one read from YAML.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ckpt.catalog import QUARANTINED_PREFIX, Catalog
from ckpt.manifest import step_dir
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from orchestrator.cli.chaos.invariants import Check, InvariantReport, check_all

# Tolerance when the data-parallel degree changed: another reduction order changes the fp32
# rounding of every all-reduced gradient, so bit equality is not expected.
ELASTIC_RTOL, ELASTIC_ATOL = 1e-5, 1e-6
REFERENCE_SUFFIX = ".reference"


def with_changes(spec, changes: Mapping[str, Any]):
    """A new validated JobSpec: `spec` with each dotted path of `changes` set (a whole section for a
    top-level key). Raises orchestrator.spec.problems.SpecError like a bad YAML file would."""
    from orchestrator.spec.job_spec import validate_spec

    data = copy.deepcopy(spec.model_dump(mode="json", by_alias=True))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return validate_spec(data)


def chaos_overrides(*, mtbf: str | None = None, kind: str | None = None, seed: int | None = None,
                    start: str | None = None, max_faults: int | None = None) -> list[str]:
    """`--set` overrides for the random-failure flags that were given (None: keep the spec's)."""
    pairs = (("mtbf_s", mtbf), ("mtbf_kind", kind), ("seed", seed), ("mtbf_start_s", start),
             ("mtbf_max_faults", max_faults))
    return [f"chaos.{key}={value}" for key, value in pairs if value is not None]


def reference_spec(spec):
    """The failure-free twin of `spec`: chaos off, name `<name>.reference` (its own checkpoint prefix)."""
    return with_changes(spec, {"name": spec.name + REFERENCE_SUFFIX, "chaos": {}})


def catalog_of(spec) -> Catalog:
    return Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))


REFERENCE_RECORD = "reference.json"  # beside the reference run's checkpoints: what made it


def reference_record(failures: int = 0) -> dict:
    """What a finished reference run's bits depend on beyond its spec (whose hash its manifests carry):
    the releases that computed them, and its failures (one that recovered is no failure-free run)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        undying = version("undying")
    except PackageNotFoundError:  # a source tree on PYTHONPATH
        undying = "unknown"
    return {"undying": undying, "torch": torch.__version__, "failures": failures}


def reference_stale(storage: Storage) -> str | None:
    """Why the finished reference run in `storage` is not to be reused (None: it is): made by other
    releases, with a failure, or by a release that recorded none of it."""
    try:
        saved = json.loads(storage.read(storage.path(REFERENCE_RECORD)))
    except Exception:  # noqa: BLE001 (absent, unreadable: not known to match)
        return f"it has no readable {REFERENCE_RECORD} (an older release made it)"
    differs = [f"{key} {saved.get(key)!r}, not {now!r}" for key, now in reference_record().items()
               if saved.get(key) != now]
    return f"it was made with {'; '.join(differs)}" if differs else None


def final_model(catalog: Catalog,
                skip: frozenset[int] = frozenset()) -> tuple[int | None, dict[str, torch.Tensor] | None]:
    """(step, every tensor: the model's and the optimizer's) of the newest committed checkpoint not in
    `skip` (corrupted on purpose); (None, None) when there is none."""
    step = max((s for s in catalog.committed_steps() if s not in skip), default=None)
    return (None, None) if step is None else (step, _model_at(catalog, step))


def _model_at(catalog: Catalog, step: int) -> dict[str, torch.Tensor]:
    tensors, _ = load_checkpoint(catalog, step, list(catalog.read_manifest(step).tensors))
    return tensors


def reference_model_at(spec, step: int) -> dict[str, torch.Tensor] | None:
    """The failure-free run's tensors at `step`: what a chaos run whose final commit was corrupted on
    purpose (its newest intact one is older) is compared with; None when the reference run's retention
    no longer holds that step (the model check then fails, naming it: nothing was compared)."""
    catalog = catalog_of(reference_spec(spec))
    return _model_at(catalog, step) if step in catalog.committed_steps() else None


def _uncaught(catalog: Catalog, steps: set[int]) -> frozenset[int]:
    """Of `steps`, those no restore quarantined (no manifest moved aside as corrupt in the step's folder)."""
    def caught(step: int) -> bool:
        names = catalog.storage.listdir(catalog.storage.path(step_dir(step)))
        return any(name.startswith(QUARANTINED_PREFIX) for name in names)

    return frozenset(step for step in steps if not caught(step))


def dp_changed(report, target_dp: int) -> bool:
    """Whether any generation of the run trained with another data-parallel degree than `target_dp`,
    or a step in the final model did: the report's generations are its last controller's, and a
    killed controller's (kill_controller) steps at a shrunken dp may survive into the final model."""
    from orchestrator.controller.step_history import surviving_history

    return any(world.dp != target_dp for world in report.world_history) or any(
        record.dp_size != target_dp for record in surviving_history(report.history))


def invariants(spec, report, *, reference: Mapping[str, torch.Tensor] | None,
               pids: Mapping[str, int] | None, measured_wall_s: float | None = None,
               elsewhere: int = 0) -> InvariantReport:
    """Every invariant check of a finished chaos run (see module doc) and, when the caller timed
    the run from outside, whether the ledger's wall fits inside that time.

    `reference`: the failure-free run's final `model/...` tensors (None: that check is skipped);
    `pids`: {label: pid} of every rank process the run had on this host (None: skipped);
    `elsewhere`: how many it had on other hosts, which that check cannot see (said in its line).
    """
    from trainer.data import make_cursor

    catalog = catalog_of(spec)
    # A corrupt_shard's step must fail its verification unless a restore caught it (quarantined: a
    # step committed there now is a clean save of it again); one that verifies was not corrupted
    # (the fault could not apply), and the check says so.
    corrupted = _uncaught(catalog, {f.step for f in report.faults if f.kind == "corrupt_shard" and f.step is not None})
    step, final = final_model(catalog, corrupted)
    unmatched = None  # the step the reference run holds no checkpoint of: nothing to compare with
    if reference is not None and step is not None and spec.train.steps in corrupted:  # the final commit
        reference = reference_model_at(spec, step)
        unmatched = step if reference is None else None
    exact = not dp_changed(report, spec.parallel.dp)
    goodput = {"productive": report.goodput.productive_s, **report.goodput.badput_s}
    result = check_all(
        catalog=catalog, expected_bad=corrupted,
        final=final if final is not None else ({} if reference is not None else None),
        reference=reference, exact=exact, rtol=ELASTIC_RTOL, atol=ELASTIC_ATOL,
        history=report.history, final_step=spec.train.steps, global_batch=spec.train.global_batch,
        cursor=make_cursor(spec.data, spec.model.vocab_size), goodput=goodput, wall_s=report.goodput.clock_wall_s,
        pids=pids, pids_elsewhere=elsewhere, reports_required=True,  # this release's run: its commits carry digests
    )
    checks = [*result.checks, check_faults_fired(spec, report, catalog, corrupted)]
    skipped = list(result.skipped)
    if unmatched is not None:  # a check that compared nothing has not passed
        skipped.remove("model_matches_reference")
        checks.append(Check("model_matches_reference", False, f"the reference run holds no checkpoint of step "
                            f"{unmatched}, the newest intact one here (the final commit was corrupted on purpose): "
                            "nothing was compared; save on a step cadence and keep more (checkpoint.keep)"))
    if measured_wall_s is not None:
        checks.append(check_wall_within(report.goodput.clock_wall_s, measured_wall_s))
    return InvariantReport(checks, skipped)


def check_faults_fired(spec, report, catalog, corrupted: Iterable[int] = ()) -> Check:
    """The faults the experiment scheduled fired: each of chaos.faults (but those that fire by chance,
    `probability`, and slow_rank, which slows without a notice), and one at least when random failures
    were asked for. A fault that never fired (its
    point has no save at its step, its rank is gone after a shrink, its glob meets no path, an MTBF longer
    than the run) was not tested, and a run none reached passes every other check trivially."""
    from chaos.config import ArmedFault
    from orchestrator.controller.kill import has_fired

    name, fired = "faults_fired", {f.fault_id for f in report.faults}
    scripted = list(enumerate(spec.chaos.faults))
    # A one-shot fault's marker says a controller fired it: a kill_controller's, and one whose notice a killed
    # controller's event log had not flushed (its rerun does not arm it again).
    fired |= {i for i, f in scripted if i not in fired and has_fired(catalog.storage, ArmedFault.of(f, i))}
    untested = _corruptions_untested(report, catalog, set(corrupted))
    if untested:
        return Check(name, False, "; ".join(untested))
    # slow_rank sends no notice (a slow step is no failure: chaos.injector); chance-triggered ones may not fire.
    missed = [f"chaos.faults[{i}] ({f.kind})" for i, f in scripted
              if f.probability is None and f.kind != "slow_rank" and i not in fired]
    if missed:
        return Check(name, False, f"{', '.join(missed)} never fired: the run did not test it (a point with no save "
                     "at its step, a rank gone after a shrink, a step past the end); move its trigger")
    skipped = len(report.faults_skipped)
    if spec.chaos.mtbf_s and not any(i >= len(scripted) for i in fired if i is not None):
        return Check(name, False, f"no random failure fired within the run (chaos.mtbf_s={spec.chaos.mtbf_s:g}"
                     + (f"; {skipped} came due with no rank to fire at" if skipped else "")
                     + "): it tested nothing random; give a shorter --mtbf or more train.steps")
    return Check(name, True, f"{len(fired)} scheduled fault(s) fired"
                 + (f"; {skipped} came due with no rank to fire at (faults_skipped in the report)" if skipped else ""))


def _corruptions_untested(report, catalog, corrupted: set[int]) -> list[str]:
    """The corrupt_shard faults that fired yet tested nothing: not applied (a storage fault hit the
    rewrite), or their step gone (retention) before any restore or check read it, uncaught: in
    `corrupted` (no quarantine) and no longer committed."""
    committed, out = set(catalog.committed_steps()), []
    for fault in (f for f in report.faults if f.kind == "corrupt_shard"):
        what = f"chaos.faults[{fault.fault_id}] (corrupt_shard at step {fault.step})"
        if fault.detail and fault.detail.startswith("could not be applied"):
            out.append(f"{what} {fault.detail}: it tested nothing")
        elif fault.step in corrupted and fault.step not in committed:
            out.append(f"{what}: retention deleted the step before any restore or check read it, so it tested "
                       "nothing; raise checkpoint.keep or corrupt a later step")
    return out


def check_wall_within(ledger_wall_s: float | None, measured_wall_s: float, slack_s: float = 0.5) -> Check:
    """The ledger's clock wall is positive and no longer than the run as timed from outside.

    Neither side is the sum of the buckets (`report.goodput.wall_s` is, so comparing it would
    test the sum against itself): `ledger_wall_s` is the ledger's own start-to-stop clock (plus
    the wall carried across controller restarts), `measured_wall_s` the driver's monotonic clock
    around the whole run, inside which the controller lives. Time carried or counted twice
    makes the first exceed the second.
    """
    name = "goodput_wall_plausible"
    if ledger_wall_s is None:
        return Check(name, False, "the report has no clock wall (goodput.clock_wall_s): written by an older release")
    if not 0.0 < ledger_wall_s <= measured_wall_s + slack_s:
        return Check(name, False, f"ledger wall {ledger_wall_s:.3f} s is not within the {measured_wall_s:.3f} s "
                     "the run took as timed from outside")
    return Check(name, True, f"ledger wall {ledger_wall_s:.1f} s of {measured_wall_s:.1f} s timed from outside "
                 f"(the rest: connecting to Ray and tearing down)")


def chaos_report(report, checks: InvariantReport, experiment: Mapping[str, Any]) -> dict:
    """The `--report` JSON: the RunReport's fields, `invariants`, and `experiment`."""
    return {**report.model_dump(mode="json"), "invariants": checks.to_dict(), "experiment": dict(experiment)}


def failed_run_report(error: str, skipped: Iterable[str] = ()) -> InvariantReport:
    """The verdict when the run left no report at all (it could not start)."""
    return InvariantReport([Check("run_finished", False, error)], list(skipped))
