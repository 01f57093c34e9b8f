"""`undying run` for a parameter-server job (`parallel.mode: ps`, paramserver/).

Called by the CLI after the spec is validated, instead of `orchestrator.cli.run.run_job`: no
controller or rank actors; the supervisor (paramserver.supervisor) checkpoints every
`checkpoint.every_steps` under the job's checkpoint root, resumes from its newest commit, replaces
a dead worker and restores the servers after a dead server (a hung one killed first by the hang
watchdog, its limits from the spec: `hang_limits`), firing the spec's kill_rank / hang_rank /
kill_server / hang_server faults, and books the wall into the goodput ledger (monitor.goodput). Connects to
Ray (or starts the embedded local one) with a logical CPU for each of the dp workers and the
servers, serves the job's Prometheus metrics on `monitor.host` /
`monitor.port` as a collective job does (monitor.ps_metrics: the staleness of every update, the
servers' bytes, observed while the workers run; the job's steps, each failure as it is booked and
each repair's detection and recovery seconds: job_feeds), runs `paramserver.job.run_ps`, prints the
report (losses, bytes per step, the staleness histogram, failures, goodput) and writes it as JSON with
`--report` (its goodput a monitor.report.GoodputSummary, as a collective report's). SIGTERM and
SIGINT stop the job at a saved cut (its last segment runs on to the end), or where it is once that
no longer fits in the grace (paramserver.preemption): exit 75, the last commit intact; one during
the set-up before (the owner lease's watch, the actors' start, the resume) stops it there, exit 75
too. A node Ray drains has the job's actors moved off it at a saved cut (paramserver.moves).
"""

from __future__ import annotations

import json
import logging
import sys
import time

from chaos.config import SERVER_KINDS
from ckpt.catalog import Catalog
from ckpt.hf_export import data_provenance
from ckpt.hf_identity import resumed_provenance, weights_provenance
from ckpt.storage import Storage
from monitor.goodput import GoodputLedger
from monitor.metrics import JobMetrics
from monitor.ps_metrics import PSMetrics, StepRate
from monitor.report import GoodputSummary
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, print_problems, serve_metrics
from orchestrator.cli.resume_check import refused_resume
from orchestrator.cli.root_lease import claim_root, took_over
from orchestrator.cli.teardown import StartUpSignals, StoppedBeforeStart, route_signals, teardown
from orchestrator.cluster import ray_cluster
from orchestrator.cluster.drain import DrainWatcher
from orchestrator.controller.ledger_snapshot import (
    LedgerSnapshots,
    book_older_restore,
    carry_from_checkpoint,
    ledger_source,
)
from orchestrator.controller.save_watch import data_outage_s
from orchestrator.controller.timeouts import (
    ASSUMED_READ_BPS_PER_RANK,
    BUILD_S,
    READ_FACTOR,
    Observed,
    derive,
    restore_timeout_s,
)
from orchestrator.spec.job_spec import JobSpec, spec_hash
from orchestrator.spec.problems import Problem
from paramserver.hang_watch import HangLimits
from paramserver.preemption import Preempted, Preemption
from paramserver.restart_budget import RestartBudget
from trainer.data import data_identity
from trainer.dtensor_slices import optimizer_fields
from trainer.model import meta_model

log = logging.getLogger(__name__)


def _weights(spec: JobSpec, fresh: bool) -> dict:
    """The record of the initial weights the job started from (ckpt.hf_identity): a resume carries its
    newest commit's; a fresh start (or a root whose newest manifest does not read now: the restore says
    why) records this spec's, whose weights are sampled only then."""
    if not fresh:
        try:
            catalog = Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))
            latest = catalog.latest()
            if latest is not None:
                return resumed_provenance({}, catalog.read_manifest(latest).state)
        except Exception as err:  # noqa: BLE001 (the store: the job's own restore meets it and says why)
            log.warning("the initial weights' record of the resumed job could not be read (%s): this spec's kept",
                        err)
    return weights_provenance(spec.model)


def supervision(spec: JobSpec, on_commit=None, fresh: bool = False) -> tuple:
    """(Checkpoints, [Fault]) of the spec, as paramserver.job.run_ps takes them; `on_commit(Commit)`
    after each checkpoint the job commits; `fresh`: `undying run --fresh`."""
    from paramserver.checkpoint import PSJob
    from paramserver.job_inputs import Checkpoints
    from paramserver.recovery import Fault

    ckpt = spec.checkpoint
    try:  # what a resume checks the data by, and an export ships; unreadable now, the checkpoints carry none
        identity, provenance = data_identity(spec.data, spec.model.vocab_size), data_provenance(spec.data, spec.model)
    except Exception as err:  # noqa: BLE001 (the store; require_data checked the data before)
        log.warning("the data's identity could not be read (%s: %s): checkpoints will not carry it",
                    type(err).__name__, err)
        identity, provenance = None, {}
    provenance = {**provenance, **_weights(spec, fresh)}
    job = PSJob(spec.name, spec.model, spec.data, spec.train, spec.parallel, spec_hash(spec), ckpt.keep, identity,
                provenance)
    save_timeout, restore_timeout = io_timeouts(spec)
    checkpoints = Checkpoints(spec.checkpoint_root, ckpt.every_steps, job, dict(ckpt.storage_options),
                              max_failed_saves=ckpt.max_failed_saves, read_retry_s=ckpt.read_retry_s,
                              save_timeout=save_timeout, restore_timeout=restore_timeout,
                              on_commit=on_commit, draining=DrainWatcher().draining, fresh=fresh)
    kinds = {"kill_rank": "worker", "hang_rank": "worker_hang", "kill_server": "server", "hang_server": "server_hang"}
    faults = [Fault(kinds[f.kind], f.server if f.kind in SERVER_KINDS else f.rank, f.at_step)
              for f in spec.chaos.faults]
    return checkpoints, faults


def io_timeouts(spec: JobSpec) -> tuple[tuple[float, str], tuple[float, str]]:
    """(seconds, what set them) of every server's write of a save and load of a restore: the collective
    restore's limit (orchestrator.controller.timeouts.restore_timeout_s: `elastic.restore_timeout_s`, auto
    120 s + checkpoint.read_retry_s + 3 x the checkpoint's bytes at 100 MB/s per server), and for a
    save the same without the read retries, or the user's number. The bytes: the parameters and their
    optimizer state, fp32."""
    params = sum(p.numel() for p in meta_model(spec.model).parameters())
    nbytes = 4 * params * (1 + len(optimizer_fields(spec.train.optimizer, spec.train.betas)))
    servers = spec.parallel.servers
    restore = restore_timeout_s(spec.elastic, servers, nbytes, None, 0.0, spec.checkpoint.read_retry_s)
    if isinstance(spec.elastic.restore_timeout_s, float | int):  # the user's number: a save gets as long
        return (restore, "elastic.restore_timeout_s"), (restore, "elastic.restore_timeout_s")
    save = BUILD_S + READ_FACTOR * nbytes / (ASSUMED_READ_BPS_PER_RANK * servers)
    return ((save, f"a ps save's limit, {BUILD_S:g} s + {READ_FACTOR:g} x its {nbytes / 1e6:.0f} MB at "
                   f"{ASSUMED_READ_BPS_PER_RANK / 1e6:.0f} MB/s per server; elastic.restore_timeout_s sets it"),
            (restore, "elastic.restore_timeout_s"))


def restart_budget(spec: JobSpec) -> RestartBudget:
    """The repairs the job may make (paramserver.restart_budget), from the elastic section."""
    elastic = spec.elastic
    return RestartBudget(elastic.max_restarts, elastic.restart_window_s, elastic.crash_loop_limit)


def hang_limits(spec: JobSpec) -> HangLimits:
    """The PS hang watchdog's limits (paramserver.hang_watch) from `elastic.hang_timeout_s` and
    `elastic.first_step_timeout_s`, derived as a collective job's (orchestrator.controller.timeouts),
    a worker's step being a dp rank's share of the global batch; a live worker may wait out its data
    store's outage (data.read_retry_s) on top."""
    limits = derive(spec.elastic, spec, spec.parallel.dp, Observed())
    return HangLimits(limits.hang_floor_s, limits.hang_factor, limits.first_step_s, data_outage_s(spec))


def stats_feed(ps_metrics: PSMetrics, metrics: JobMetrics, ledger: GoodputLedger, every_steps: int | None,
               snapshots: LedgerSnapshots | None = None):
    """run_ps's `on_stats` (the supervisor's, every second on the driver's thread): the servers'
    counters, the goodput ledger's totals (a resumed job's carried before the first call:
    carry_goodput) and, with checkpoints every `every_steps`, the interval between commits
    at the measured step rate; `snapshots`: the goodput snapshot rewritten every few seconds (its
    own thread), so a driver that dies leaves its time and its repairs to the next run, as a
    collective controller does. Returns how many updates the call counted."""
    rate = StepRate()

    def on_stats(stats) -> int:
        counted = ps_metrics.on_server_stats(stats)
        metrics.on_goodput(ledger)
        if snapshots is not None:
            snapshots.maybe_save(ledger)
        steps_per_s = rate.on_stats(stats)
        if every_steps and steps_per_s:
            metrics.on_checkpoint_interval(every_steps / steps_per_s)
        return counted
    return on_stats


def job_feeds(ps_metrics: PSMetrics, metrics: JobMetrics, workers: int) -> dict:
    """run_ps's `on_step` and `on_failure`, both feeding the driver's metrics (each step also exports the
    recoveries it completed: a replaced worker's ends at its replacement's first push)."""
    on_step, on_failure = step_feed(ps_metrics, metrics, workers), failure_feed(metrics, workers)

    def stepped(log) -> None:
        on_step(log)
        on_failure.settle()
    return {"on_step": stepped, "on_failure": on_failure}


def failure_feed(metrics: JobMetrics, workers: int):
    """run_ps's `on_failure` (each failure as the supervisor books it, on the driver's thread): the failure
    series as a collective job exports them, which the dashboard's failure panels and the restart-storm
    alert read: undying_failures_total by kind (worker_died, server_died, torn_push, hang, run_error),
    undying_generation counting the failures repaired, each a re-formation of the job, and, through its
    `settle()`, each repair's detection (an injected fault's onset to its detection) and recovery
    (detection to training again: a restore's once it is told, a replaced worker's once its pause is
    measured) as undying_detection_seconds and undying_recovery_seconds."""
    repaired, awaiting = 0, []
    metrics.on_layout(0, workers, workers, 1, 1)

    def settle() -> None:
        for failure in list(awaiting):
            if failure.action == "pending":  # a torn push, until its rollback restores: told again then
                continue
            recovered = failure.pause_s if failure.action == "replaced" else time.time() - failure.detected_at
            if recovered is None:
                continue
            awaiting.remove(failure)
            onset = failure.injected_at
            metrics.on_recovery(failure.detected_at - onset if onset is not None else None, recovered)

    def on_failure(failure) -> None:
        nonlocal repaired
        kinds = {"worker": "worker_died", "server": "server_died"}
        metrics.on_failure("hang" if failure.hung else kinds.get(failure.kind, failure.kind))
        repaired += 1
        metrics.on_layout(repaired, workers, workers, 1, 1)
        awaiting.append(failure)
        settle()
    on_failure.settle = settle
    return on_failure


def step_feed(ps_metrics: PSMetrics, metrics: JobMetrics, workers: int):
    """run_ps's `on_step` (each worker step's log, on the driver's thread): its pull wait, and, once
    every worker's log of a step is in, the job's step series as a collective job exports them
    (undying_step, undying_step_seconds: the slowest worker's, undying_tokens_total, undying_loss:
    token-weighted), which the dashboard's job list and panels read. A step a rollback redoes is
    exported again: both ran."""
    pending: dict[int, dict] = {}  # step -> {worker: its log} (a redone step's replaces the undone one's)

    def on_step(log) -> None:
        ps_metrics.on_steps([log])
        logs = pending.setdefault(log.step, {})
        logs[log.worker] = log
        if len(logs) == workers:
            done = pending.pop(log.step).values()
            tokens = sum(x.tokens for x in done)
            metrics.on_step(log.step, max(x.pull_wait_s + x.compute_s + x.push_s for x in done), tokens,
                            sum(x.loss_sum for x in done) / max(1, tokens), None)
        for step in [s for s in pending if s < log.step - 1000]:  # a rollback's, never completed
            del pending[step]
    return on_step


def capacity_problem(spec: JobSpec, cluster: dict[str, float]) -> Problem | None:
    """The CPUs a PS job's actors take (one each: paramserver.job) that the cluster
    (`ray.cluster_resources()`) can never give, as a problem naming the fields (pure)."""
    par, have = spec.parallel, cluster.get("CPU", 0.0)
    if have >= par.dp + par.servers:
        return None
    return Problem("parallel.servers", f"{par.dp} workers (parallel.dp) + {par.servers} servers x 1 CPU = "
                                       f"{par.dp + par.servers} CPU, but the cluster has {have:g}; lower parallel.dp "
                                       "or parallel.servers, or add nodes")


def _refused_capacity(spec: JobSpec) -> bool:
    """Whether the cluster can never seat the job's actors (printed): else they would wait for seats forever."""
    import ray

    problem = capacity_problem(spec, ray.cluster_resources())
    if problem is not None:
        print_problems([problem])
    return problem is not None


def _announce(spec: JobSpec, port: int, checkpoints, hang: HangLimits) -> None:
    par = spec.parallel
    print(f"undying: job {spec.name!r}, parameter server ({par.consistency}): {par.dp} workers, "
          f"{par.servers} servers, metrics at http://{spec.monitor.host}:{port}/metrics; checkpoints every "
          f"{checkpoints.every_steps} steps at {checkpoints.root}; {hang.describe()}", flush=True)


def run_ps_job(spec: JobSpec, address: str | None, report_path: str | None, timeline_path: str | None,
               fresh: bool = False) -> int:
    if timeline_path:
        print_problems([Problem("--timeline", "parameter-server jobs do not draw a timeline yet; leave it out")])
        return EXIT_USAGE
    from paramserver.job import run_ps

    par = spec.parallel
    ledger, started_at, hang = GoodputLedger(), time.time(), hang_limits(spec)  # start-up from here: Ray, the actors
    metrics, preemption = JobMetrics(spec.name), Preemption(spec.elastic.preemption_grace_s)

    def on_commit(commit) -> None:
        # A PS save blocks every worker until it commits: its whole time is what it cost training.
        metrics.on_checkpoint(commit.step, commit.nbytes, commit.total_s, commit.total_s, None)
        preemption.on_commit(commit)

    checkpoints, faults = supervision(spec, on_commit=on_commit, fresh=fresh)
    conn = ray_cluster.connect(address, par.dp + par.servers, 0)
    ps_metrics = PSMetrics(spec.name, par.consistency, par.servers, metrics.registry)
    start_up = StartUpSignals()
    restore_signals = route_signals(start_up.on_signal)  # until the supervisor's preemption takes them
    try:
        checkpoints.owner = None if _refused_capacity(spec) else claim_root(spec)
        if checkpoints.owner is None or refused_resume(spec):
            return EXIT_USAGE
        snapshots, earlier = carry_goodput(spec, ledger, started_at, checkpoints.owner, checkpoints)
        on_stats = stats_feed(ps_metrics, metrics, ledger, checkpoints.every_steps, snapshots)
        port = serve_metrics(metrics, spec)
        if port is None or not took_over(spec):  # the last refusal before training
            return EXIT_USAGE
        _announce(spec, port, checkpoints, hang)
        checkpoints.preemption = preemption  # until the actors are up and resumed a signal stops the driver at once
        checkpoints.on_training = lambda: route_signals(preemption.on_signal)  # (restore_signals puts Ray's back)
        try:
            feeds = job_feeds(ps_metrics, metrics, par.dp)
            report = run_ps(spec.model, spec.data, spec.train, par, on_stats=on_stats, checkpoints=checkpoints,
                            faults=faults, ledger=ledger, **feeds, hang=hang,
                            budget=carried_budget(spec, snapshots, earlier))
            feeds["on_failure"].settle()  # a recovery that the job's last step (or none) ended
        except Preempted as stop:
            print(f"undying: job preempted: {stop}", file=sys.stderr)
            return EXIT_PREEMPTED
        except Exception as err:  # noqa: BLE001 (any actor's failure fails the job, reported in one line)
            print(f"undying: job failed: {type(err).__name__}: {err}", file=sys.stderr)
            return EXIT_FAILED
        finally:  # it ended on its own: a rerun books no wait before it (the operator's), as a collective job's
            preemption.ending = True  # a second signal is recorded from here: the snapshot, report and teardown run
            snapshots.save(ledger, ended=True)
        print(report.summary(), flush=True)
        if report_path:
            _write_report(spec, report, report_path)
        return EXIT_OK
    except StoppedBeforeStart as stop:
        print(f"undying: job preempted: {stop}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    finally:
        preemption.ending = True  # a second signal now must not cut the lease's release short (teardown)
        start_up.end()
        teardown([checkpoints.owner.release if checkpoints.owner is not None else None, metrics.close, conn.close])
        restore_signals()


def carried_budget(spec: JobSpec, snapshots: LedgerSnapshots, snapshot: dict | None) -> RestartBudget:
    """The job's restart budget, less the repairs its earlier runs made (recorded with `snapshot`,
    the goodput snapshot the last driver wrote as it ended; a rerun does not renew the budget), which
    this run's `snapshots` record in turn."""
    budget = restart_budget(spec)
    saved = snapshot.get("failures", []) if snapshot else []
    budget.carry([float(f["at"]) for f in saved if isinstance(f, dict) and isinstance(f.get("at"), int | float)])
    snapshots.failures = lambda: [{"kind": "repair", "at": at} for at in budget.repair_times()]
    return budget


def carry_goodput(spec: JobSpec, ledger: GoodputLedger, started_at: float, owner,
                  checkpoints=None) -> tuple[LedgerSnapshots, dict | None]:
    """A resumed job: the goodput its newest checkpoint saved joins `ledger`, resumed against the
    snapshot the last driver wrote as it ended (ledger_snapshot.resume_totals: after a driver that
    ended on its own no wait is booked; after one that died the time since its commit is `other`),
    so the job's goodput spans its runs as a collective job's does. Before the first export of the
    ledger. A manifest that cannot be read leaves the ledger as it is: the restore reports the error.
    Returns the snapshots (`owner`: the driver's lease), where the driver writes its own end, and the
    last driver's snapshot (read once: the restart budget carries its repairs too). `checkpoints` (the
    supervisor's): told, once the job resumed, to book the work redone when the restore landed older
    than the commit carried (that one proved corrupt): ledger_snapshot.book_older_restore."""
    from paramserver import checkpoint

    root, options = spec.checkpoint_root, spec.checkpoint.storage_options
    snapshots = LedgerSnapshots(Storage(root, options), owner=owner, background=True)  # a slow store: not the loop's
    snapshot = snapshots.load()
    catalog = checkpoint.catalog(root, options)
    try:
        latest = catalog.latest()
        manifest = None if latest is None else catalog.read_manifest(latest)
    except Exception as err:  # noqa: BLE001 (telemetry: the job's own restore meets the same store)
        log.warning("the resumed job's goodput is not carried: its checkpoint could not be read (%s)", err)
        return snapshots, snapshot
    if manifest is not None:
        carry_from_checkpoint(manifest, ledger, [], snapshots, started_at, snapshot)
        if checkpoints is not None:
            source = ledger_source(latest, manifest)
            checkpoints.on_resumed = lambda step: log.info(
                "resumed%s", book_older_restore(ledger, source, step, catalog.read_manifest))
    return snapshots, snapshot


def _write_report(spec: JobSpec, report, path: str) -> None:
    """The succeeded job's report as JSON (`--report`): its losses, staleness and traffic, its goodput
    (monitor.report.GoodputSummary, as a collective job's report gives it)."""
    total, per_server = report.bytes_per_step()
    goodput = GoodputSummary.from_totals(report.goodput).model_copy(update={"clock_wall_s": report.wall_s})
    with open(path, "w") as out:
        json.dump({"name": spec.name, "status": "succeeded", "mode": "ps", "consistency": spec.parallel.consistency,
                   "losses": report.losses, "wall_s": report.wall_s,
                   "staleness_histogram": {str(k): v for k, v in report.staleness_histogram().items()},
                   "bytes_per_step": total, "bytes_per_step_per_server": per_server,
                   "state_bytes": report.state_bytes, **report.to_dict(),
                   "goodput": goodput.model_dump(mode="json")}, out, indent=1)
    print(f"report written to {path}")
