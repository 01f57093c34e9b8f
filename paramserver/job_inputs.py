"""What a parameter-server job's supervisor (paramserver.supervisor) is given: how to start its
actors, and where and how to checkpoint.

Built by paramserver.job.run_ps (`Actors`, binding the shard plan and the configs) and by the
driver (`Checkpoints`: orchestrator/cli/ps_run.py, from the spec), read by the supervisor and by
paramserver.moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ckpt.config import DEFAULT_READ_RETRY_S
from ckpt.ownership import OwnerLease
from paramserver import checkpoint
from paramserver.preemption import Preemption


@dataclass
class Actors:
    """How the supervisor starts a server (index k) or a worker (index w); the test of a stopped
    worker's speed: `slow` {worker: seconds slept per step}."""

    start_server: Callable[[int], object]
    start_worker: Callable[[int], object]
    slow: dict[int, float] = field(default_factory=dict)


@dataclass
class Checkpoints:
    root: str  # the job's checkpoint root (<checkpoint.url>/<name>)
    every_steps: int | None
    job: checkpoint.PSJob
    storage_options: dict | None = None
    max_failed_saves: int = 3  # checkpoint.max_failed_saves (ckpt.failed_saves)
    read_retry_s: float = DEFAULT_READ_RETRY_S  # checkpoint.read_retry_s: a restore's transient read failures
    # (seconds, the spec field that gave them): how long every server's write of a save, and its
    # load of a restore, may take (paramserver.checkpoint.ServersTimedOut); None: no limit.
    save_timeout: tuple[float, str] | None = None
    restore_timeout: tuple[float, str] | None = None
    # Called with each Commit this run makes (the job's Prometheus exporter: the last commit's time
    # and size, which the "no checkpoint lately" alert reads).
    on_commit: Callable[[object], None] | None = None
    owner: OwnerLease | None = None  # the driver's lease on `root` (ckpt.ownership): every commit is fenced by it
    preemption: Preemption | None = None  # `undying run`'s signals (paramserver.preemption)
    draining: Callable[[], Iterable[str]] | None = None  # the nodes Ray drains (orchestrator.cluster.drain)
    # Called once the actors are up and the resume is done, before the first segment: `undying run`
    # routes its signals to `preemption` from then on (before, a signal stops the driver at once).
    on_training: Callable[[], None] | None = None
    # Called with the step the job resumed at (the driver books the work redone when it is older than
    # the commit whose ledger it carried).
    on_resumed: Callable[[int], None] | None = None
    fresh: bool = False  # `undying run --fresh`: a root whose every commit was quarantined starts from step 0
