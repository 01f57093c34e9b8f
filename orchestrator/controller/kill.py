"""The `kill_controller` chaos fault: the controller SIGKILLs itself, once per job.

Protocol (orchestrator.controller.faults.ControllerFaults owns one `ControllerKill`, built with
the job's armed faults and the catalog's Storage, before the controller's first state):
  * `on_step(step)` is called for every step the controller learns finished (rank 0's `step`
    event); a fault with only `at_step` fires at the first such step at or after it.
  * `at_point(point, step)` is called at the controller's fault points: around each manifest
    commit ("before_manifest_commit", "after_manifest_commit", chaos.config.CONTROLLER_POINTS),
    `step` being the checkpoint's. A fault with `at_point` fires at the first commit of a step at
    or after its `at_step` (any commit without one).
  * Firing: first the fault is recorded as fired in a marker file beside the checkpoints
    (`<checkpoint root>/chaos/fired-<id>-<digest>.json`, an exclusive create), then a line is
    printed and flushed, then the process SIGKILLs itself: no `finally`, no teardown, as a
    crashed driver. Ray then ends the dead driver's rank actors (an actor dies with its owner),
    and running the same job again resumes from its last committed checkpoint.
  * Fire once per job: a controller skips every fault whose marker exists, so the rerun passes
    the same step or commit without dying again. When the marker cannot be written (a storage
    error), the fault is dropped with a printed reason instead of firing: a kill that would
    repeat on every rerun would make the job unable to finish.

The digest is of the fault's own fields, so an edited fault at the same index arms afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from chaos.config import CONTROLLER_POINTS, ArmedFault, as_armed
from ckpt.storage import AlreadyCommitted

log = logging.getLogger(__name__)
MARKER_DIR = "chaos"


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def marker_name(fault: ArmedFault) -> str:
    """File name of the marker that says `fault` fired: its id and a digest of its spec fields."""
    fields = fault.model_dump(exclude={"id"})
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"fired-{fault.id}-{digest}.json"


def has_fired(storage, fault: ArmedFault) -> bool:
    """Whether a controller of this job (this checkpoint root) already fired `fault`."""
    return storage.exists(storage.path(MARKER_DIR, marker_name(fault)))


class ControllerKill:
    def __init__(self, faults: list[ArmedFault], storage, printer=print, job_seconds: Callable[[], float] = lambda: 0.0,
                 kill: Callable[[], None] | None = None):
        self.storage = storage
        self.printer = printer
        self.job_seconds = job_seconds
        self.kill = kill if kill is not None else _sigkill  # tests pass one that raises instead
        mine = [f for f in (as_armed(f, i) for i, f in enumerate(faults)) if f.kind == "kill_controller"]
        self.armed = [f for f in mine if not has_fired(storage, f)]
        self.spent = [f for f in mine if f not in self.armed]  # fired by an earlier controller of this job

    def on_step(self, step: int) -> None:
        for fault in list(self.armed):  # _fire removes it (and goes on when the kill is skipped)
            if fault.at_point is None and step >= fault.at_step:
                self._fire(fault, "step", step)

    def at_point(self, point: str, step: int) -> None:
        for fault in list(self.armed):  # _fire removes it (and goes on when the kill is skipped)
            if fault.at_point == point and step >= (fault.at_step or 0):
                self._fire(fault, point, step)

    def _fire(self, fault: ArmedFault, point: str, step: int) -> None:
        self.armed.remove(fault)
        where = f"at {point} of step {step}" if point in CONTROLLER_POINTS else f"after step {step}"
        record = {"fault_id": fault.id, "kind": "kill_controller", "point": point, "step": step,
                  "time": time.time(), "job_s": self.job_seconds(), "pid": os.getpid()}
        try:
            self.storage.create_exclusive(self.storage.path(MARKER_DIR, marker_name(fault)),
                                          json.dumps(record).encode())
        except AlreadyCommitted:
            self.printer(f"chaos: kill_controller {where} skipped: another controller of this job fired it")
            return
        except (OSError, ValueError) as err:
            log.error("kill_controller %s not fired: its marker could not be written (%s)", where, err)
            self.printer(f"chaos: kill_controller {where} NOT fired: recording that it fired failed "
                         f"({type(err).__name__}: {err}), and a kill nobody remembers would repeat on every rerun")
            return
        self.printer(f"chaos: kill_controller {where}: the controller kills itself (SIGKILL); "
                     "run the job again to resume from its last committed checkpoint")
        sys.stdout.flush()
        sys.stderr.flush()
        self.kill()
