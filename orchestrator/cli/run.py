"""Wire one job together in the driver process: Ray, store, metrics, workers, controller.

Called by the CLI after the spec is validated. Order matters: the cluster capacity check
runs before any actor exists (so an impossible request exits 2, naming the field), the
store and the metrics endpoint exist before the first rank, and everything is torn down
by PID/handle in `finally`, whatever happened.

SIGTERM and SIGINT (`ray job stop`, a head pod's eviction through its preStop hook, Ctrl-C) are handed to the
controller while it runs (orchestrator.controller.stopping: the handler only records the
signal): the job checkpoints at the next step boundary and exits 75 (EXIT_PREEMPTED). One during
the set-up before it (from Ray's connection: the owner lease's watch, the actors' start) stops the
driver at once with the same exit 75: there is nothing to checkpoint yet.

Before anything writes to the checkpoint root the driver takes its owner lease (ckpt.ownership):
a second driver of a live job exits 2 naming the first; the lease is released once the ranks
and the trackers are closed. Each teardown step runs whatever the others raised, and a signal
during the report or the teardown is recorded, never raised into them.

The run's events go to its trackers (monitor.tracking), opened here before the controller and
closed last: the event log under the checkpoint root always (`undying report` reads it), and
TensorBoard and W&B where the spec's `monitor` section asks for them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from monitor.tracking import NO_TRACKING, TrackerUnavailable, open_trackers
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, print_problems, serve_metrics
from orchestrator.cli.resume_check import refused_resume
from orchestrator.cli.root_lease import claim_root, leased_catalog, took_over
from orchestrator.cli.teardown import StartUpSignals, StoppedBeforeStart, route_signals, teardown
from orchestrator.cluster import ray_cluster
from orchestrator.cluster.capacity import (
    capacity_problems,
    cpu_ranks_note,
    device_memory_note,
    host_memory_note,
    node_problems,
    resolve_spares,
    slots,
)
from orchestrator.cluster.drain import DrainWatcher
from orchestrator.cluster.worker_group import RayWorkerGroup
from orchestrator.controller.machine import Controller
from orchestrator.spec.job_spec import HASH_EXCLUDED, JobSpec
from orchestrator.spec.problems import Problem
from orchestrator.wire.store import RendezvousServer


def run_job(spec: JobSpec, address: str | None, report_path: str | None, timeline_path: str | None,
            worker_group: Callable[..., RayWorkerGroup] = RayWorkerGroup, fresh=False, experiment=False) -> int:
    """Run the job to its end; returns the exit code. `worker_group(spec, env_vars=...)` builds the rank
    actors' group (the chaos command's records the rank PIDs, and passes `experiment`: root_lease).
    `fresh`: from step 0 (`undying run --fresh`: the CLI checked no committed checkpoint is in the way)."""
    import ray

    world = spec.world_size
    conn = ray_cluster.connect(address, slots(spec) * spec.resources.cpus_per_rank,
                               slots(spec) * spec.resources.gpus_per_rank)
    metrics = JobMetrics(spec.name)
    workers, trackers, lease, controller = None, NO_TRACKING, None, None
    start_up = StartUpSignals()
    restore_signals = route_signals(start_up.on_signal)  # until the controller takes them over
    try:
        # `auto` spares become a number here, against what the cluster has free before any actor exists.
        nodes = ray_cluster.alive_node_resources()  # one GCS read for the checks below
        spares, note = resolve_spares(spec, ray.available_resources(), nodes)
        spec = spec.model_copy(update={"elastic": spec.elastic.model_copy(update={"spares": spares})})
        problems = capacity_problems(spec, cluster := ray.cluster_resources()) or node_problems(spec, nodes)
        if problems:
            print_problems(problems)
            return EXIT_USAGE
        for warning in (cpu_ranks_note(spec, cluster), device_memory_note(spec, cluster),
                        host_memory_note(spec, nodes)):
            if warning:  # (not `note`: the spares' sentence the job line carries)
                print(f"undying: WARNING: {warning}", file=sys.stderr, flush=True)
        port = serve_metrics(metrics, spec)
        if port is None:
            return EXIT_USAGE
        print(f"undying: job {spec.name!r}, {world} ranks, metrics at http://{spec.monitor.host}:{port}/metrics, "
              f"checkpoints in {spec.checkpoint_root}" + (f"; {note}" if note else ""), flush=True)
        lease = claim_root(spec)
        catalog = leased_catalog(spec, lease) if lease is not None else None
        if catalog is None or refused_resume(spec):
            return EXIT_USAGE
        # A Storage of their own: the catalog's carries the chaos storage faults aimed at the checkpoints.
        trackers = _trackers(spec, Storage(spec.checkpoint_root, spec.checkpoint.storage_options)) or NO_TRACKING
        if trackers is NO_TRACKING or not (experiment or took_over(spec)):  # the last refusal before training
            return EXIT_USAGE
        workers = worker_group(spec, env_vars=conn.env_vars)
        rendezvous = RendezvousServer(conn.rendezvous_host, on_reject=metrics.on_control_rejected,
                                      on_missing=metrics.on_control_missing)
        controller = Controller(spec, workers, rendezvous, catalog, metrics, fresh=fresh,
                                printer=lambda line: print(line, flush=True), drains=DrainWatcher().draining)
        controller.record.tracker = trackers
        # From here to the end of the teardown a signal is the controller's to record: never an
        # exception that cuts the report or the teardown short (the lease release among them).
        route_signals(controller.stops.on_signal)  # (`restore_signals` still puts Ray's handlers back)
        report = controller.run()
        return _outcome(report, report_path, timeline_path)
    except StoppedBeforeStart as stop:
        print(f"undying: job preempted: {stop}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    finally:
        start_up.end()  # a set-up that returned early: a signal now must not cut the teardown short
        teardown([workers.shutdown if workers is not None else None,
                  lambda: trackers.close(_trackers_wait_s(controller, start_up, spec)),
                   lease.release if lease is not None else None, metrics.close, conn.close])
        restore_signals()


def _trackers_wait_s(controller, start_up: StartUpSignals, spec) -> float | None:
    """How long the trackers' last writes may keep the driver (the lease is released after them): what
    a signal's grace left (the controller's clock), half the grace for one that stopped the set-up,
    no bound without a signal."""
    if controller is not None:
        return controller.stops.end_wait_s()
    return spec.elastic.preemption_grace_s / 2 if start_up.signals else None


def _outcome(report, report_path: str | None, timeline_path: str | None) -> int:
    """Print the job's report, write its files, and say how it ended: the exit code."""
    print(report.summary_table(), flush=True)
    if report_path:
        report.to_json(report_path)
        print(f"report written to {report_path}")
    if timeline_path:
        from monitor.timeline import plot_timeline

        plot_timeline(report, timeline_path)
        print(f"timeline written to {timeline_path}")
    if report.status == "preempted":
        print(f"undying: job preempted: {report.error}", file=sys.stderr)
        return EXIT_PREEMPTED
    if report.status != "succeeded":
        print(f"undying: job failed: {report.error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _trackers(spec: JobSpec, storage: Storage):
    """The run's trackers (monitor.tracking), opened before any rank exists; None, with the problem
    printed, when a configured one cannot start."""
    try:
        trackers = open_trackers(spec.name, spec.train.steps, spec.monitor, storage, spec.checkpoint.storage_options,
                                 spec.model_dump(mode="json", exclude=HASH_EXCLUDED))
    except TrackerUnavailable as err:
        print_problems([Problem(err.field, err.message)])
        return None
    print(f"undying: tracking to {trackers.where()}", flush=True)
    return trackers
