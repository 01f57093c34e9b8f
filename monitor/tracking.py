"""Experiment tracking: the run's events fanned out to the event log, TensorBoard and W&B.

Protocol. The CLI's `run_job` calls `open_trackers(...)` once in the driver, before the
controller exists, and `close()` in its `finally`. The controller's `JobRecord` calls `emit(event)`
for every event it builds (monitor.events: one per step, validation, layout, failure update,
injected fault, commit, goodput sample, and the end), on the controller thread only. `emit` hands the event to
each sink and flushes them every `flush_every_s`, at each commit, failure and injected fault and at
the end, so what was learned before a pod died is already stored.

Tracking is telemetry: a sink that raises is logged once and dropped; the job never stops for
it. Which packages a configured sink needs is checked before the job starts
(`tracking_problems`, called where the spec is loaded); a configured sink that cannot start (a
directory it cannot create, W&B without credentials) raises `TrackerUnavailable` from
`open_trackers`, before any rank exists, naming its field.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ckpt.storage_options import error_reason
from monitor.config import MonitorConfig

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 10.0
# Flushed at once: a commit's record survives with the commit, and a failure's or an injected fault's
# a controller killed right after (`undying chaos` joins a killed run's log into its report). All are rare.
_FLUSH_KINDS = ("checkpoint", "failure", "fault", "end")


class TrackerUnavailable(Exception):
    """A configured tracker could not start; `field` names the spec field (`monitor.wandb`...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class Sink(Protocol):
    """One destination of the run's events. Called from the controller thread only."""

    name: str
    where: str  # where its records go, for the job's start-up line

    def emit(self, event: dict) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class Trackers:
    """The sinks of one run, fed in order; a sink that raises is dropped (logged once)."""

    def __init__(self, sinks: Sequence[Sink] = (), flush_every_s: float = FLUSH_EVERY_S, clock=time.monotonic):
        self.sinks = list(sinks)
        self.flush_every_s = flush_every_s
        self.clock = clock
        self._flushed_at = clock()

    def emit(self, event: dict) -> None:
        self._each("emit", event)
        if event["kind"] in _FLUSH_KINDS or self.clock() - self._flushed_at >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self._flushed_at = self.clock()
        self._each("flush")

    def where(self) -> str:
        return "; ".join(f"{sink.name} {sink.where}" for sink in self.sinks)

    def close(self, within_s: float | None = None) -> None:
        """Flush and close every sink; the last writes finish before this returns, or `within_s` has
        passed (what a preemption's grace left the driver: W&B's finish or a TensorBoard upload to a
        slow store must not keep it past the SIGKILL that follows, with its lease unreleased). The
        sinks still closing then finish on their thread while the driver tears down the rest."""
        sinks, self.sinks = self.sinks, []
        closing = threading.Thread(target=_close_all, args=(sinks,), daemon=True, name="undying-trackers-close")
        closing.start()
        closing.join(within_s if within_s is not None and math.isfinite(within_s) else None)
        if closing.is_alive():
            log.warning("tracking: %s still closing after %g s (the grace left); their last records may be "
                        "missing", ", ".join(sink.name for sink in sinks), within_s)

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # telemetry: never a reason to stop training
                log.warning("tracking: %s failed in %s (%s); it records nothing more for this run",
                            sink.name, method, err)
                self.sinks.remove(sink)


def _close_all(sinks: list[Sink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as err:  # telemetry: logged, and the next sink still closes
            log.warning("tracking: %s failed in close (%s); it records nothing more for this run", sink.name, err)


NO_TRACKING = Trackers()


def tracking_problems(monitor: MonitorConfig) -> list[tuple[str, str]]:
    """(field, message) for each configured tracker this machine cannot run: a package or an
    fsspec protocol missing. Checked before the job starts, so a run never ends without its record."""
    problems = []
    if monitor.tensorboard is not None:
        if importlib.util.find_spec("tensorboard") is None:
            problems.append(("monitor.tensorboard", "the tensorboard package is not installed: "
                             "pip install 'undying[tensorboard]', or remove monitor.tensorboard"))
        reason = _protocol_problem(monitor.tensorboard)
        if reason:
            problems.append(("monitor.tensorboard", reason))
    if monitor.wandb is not None and importlib.util.find_spec("wandb") is None:
        problems.append(("monitor.wandb", "the wandb package is not installed: pip install 'undying[wandb]', "
                         "or remove monitor.wandb"))
    return problems


def _protocol_problem(url: str) -> str | None:
    import fsspec

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as err:
        return f"{url}: cannot write to {protocol}:// here ({err}); use a local directory, file:// or s3:// " \
               "(with s3fs installed)"
    return None


def open_trackers(job: str, total_steps: int, monitor: MonitorConfig, storage, storage_options: dict,
                  config: dict) -> Trackers:
    """The trackers of one run of the controller: the event log under the checkpoint root
    (`storage`, always), TensorBoard at `monitor.tensorboard` (opened with `storage_options`,
    the checkpoint's) and W&B when `monitor.wandb` is set (`config`: the spec without credentials,
    shown with the run). Emits the `start` event. Raises TrackerUnavailable when one cannot start
    (the ones already started are closed)."""
    from monitor.event_log import EventLog
    from monitor.events import event

    trackers = Trackers([EventLog(storage)])
    if monitor.tensorboard is not None:
        from monitor.tensorboard_sink import TensorBoardSink

        _start(trackers, "monitor.tensorboard", lambda: TensorBoardSink(monitor.tensorboard, storage_options))
    if monitor.wandb is not None:
        from monitor.wandb_sink import WandbSink

        _start(trackers, "monitor.wandb", lambda: WandbSink(monitor.wandb, job, config))
    trackers.emit(event("start", 0, job=job, total_steps=total_steps))
    return trackers


def _start(trackers: Trackers, field: str, build) -> None:
    try:
        trackers.sinks.append(build())
    except Exception as err:
        trackers.close()
        raise TrackerUnavailable(field, f"cannot start ({error_reason(err, 300)}); fix it or remove {field}") from err
