"""The controller's five timeouts (`elastic.*_timeout_s`), derived from what the job measured.

    hang           no step for this long is a hang: max(10 s, 5 x the median step), plus a due
                   validation's allowance (policies.hang_limit)
    first step     a generation's first step (compilation, autotuning, communicators, cold
                   caches): 3 x the slowest first step measured so far; before any, the cost
                   model's compute bound of one step times 20, at least 120 s on CPU, 600 s on GPU
    process group  a collective's timeout, the last resort behind the watchdog: 2 x the longer
                   of the two above (fixed when a generation forms), at least 60 s, and at
                   least a data outage (data.read_retry_s) plus the hang limit for prepared
                   datasets, whose peers wait in a collective while one rank's reads are retried
    restore        forming + building the engine (join + 120 s) + the read-retry budget + 3 x the
                   checkpoint's bytes over the read bandwidth (measured by the last restore from
                   storage, else 100 MB/s per rank)
    release        a survivor leaves at its next collective, within one step: max(3 s, 2 x the
                   median step), before any step 2 x the compute bound; during a generation's
                   first step, whatever is left of the first step's limit if longer

A number in the spec replaces the derived value ("auto", the default). `derive` is pure; the
`Timeouts` object feeds it what the job measured.

Protocol (controller thread only): `for_generation(world)` when a generation forms (its limits,
logged in one line when they changed), `restore_s(world, checkpoint_bytes(step, read_manifest))`
before the ranks restore, `on_restored(results, seconds, from_storage)` after,
`on_training_started()` when the generation trains, `hang_limit()` at every poll of the progress
watchdog, `release_s()` at every release.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from orchestrator.controller.policies import hang_limit
from orchestrator.controller.save_watch import data_outage_s
from orchestrator.spec.elastic import FIRST_STEP_FLOOR_S, HANG_FLOOR_S
from trainer.costmodel.hardware import GPUS
from trainer.costmodel.layout import Workload
from trainer.model import flops_per_token

HANG_FACTOR = 5.0  # the hang limit: max(HANG_FLOOR_S, this x the median step)
# Before any step is measured: the compute bound at peak is 2-3x below a real step at 30-40% MFU,
# and a first step adds torch.compile, kernel autotuning and NCCL's lazy communicator set-up.
FIRST_STEP_FACTOR = 20.0
FIRST_STEP_REPEAT = 3.0  # a later generation's first step against the slowest one measured
# ... and at least this, measured or not: a first step measured short may have found a warm compile
# cache (a resume on the same nodes), which a replacement on another node does not have; killing it
# as hung would kill its replacement too, a crash loop that fails the job.
MEASURED_FIRST_STEP_FLOOR_S = {"cpu": HANG_FLOOR_S, "gpu": 120.0}
COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR = 60.0, 2.0
BUILD_S = 120.0  # building a rank's engine, beside its reads
READ_FACTOR = 3.0
ASSUMED_READ_BPS_PER_RANK = 100e6  # one rank's reads of an object store or a shared file system
RELEASE_FLOOR_S, RELEASE_FACTOR = 3.0, 2.0
# Peak FLOP/s per rank before the ranks report theirs: low, so the estimate errs long.
ASSUMED_CPU_PEAK = 1e10


@dataclass(frozen=True)
class Observed:
    """What the job measured so far; None: not yet."""

    median_step_s: float | None = None
    first_step_s: float | None = None  # the slowest first step of a generation (warm-up included)
    peak_flops_per_rank: float | None = None
    read_bytes_per_s: float | None = None  # the last restore from storage: bytes read / its seconds


@dataclass(frozen=True)
class Limits:
    hang_floor_s: float  # steady hang limit: max(hang_floor_s, hang_factor x median step)
    hang_factor: float
    first_step_s: float
    collective_s: float
    release_s: float

    def line(self, restore: str) -> str:
        hang = f"{self.hang_floor_s:g} s" if not self.hang_factor else \
            f"max({self.hang_floor_s:g} s, {self.hang_factor:g} x median step)"
        return (f"timeouts: hang {hang}, first step {self.first_step_s:.0f} s, process group "
                f"{self.collective_s:.0f} s, restore {restore}, release {self.release_s:.1f} s")


def compute_bound_s(spec, world: int, peak_flops_per_rank: float | None) -> float:
    """The cost model's compute term of one step (trainer.costmodel.time): the step's training FLOPs
    over `world` ranks at peak. With no measured peak, an assumed low one (the table's slowest GPU,
    or 10 GFLOP/s per CPU rank), so the estimate errs long."""
    work = Workload.from_spec(spec)
    peak = peak_flops_per_rank
    if not peak or peak != peak:  # None, 0 or NaN (a GPU the table does not know)
        peak = GPUS["a100"].peak(work.precision) if spec.resources.gpus_per_rank > 0 else ASSUMED_CPU_PEAK
    return flops_per_token(work.model, work.seq_len) * work.tokens_per_step / (world * peak)


def derive(elastic, spec, world: int, seen: Observed) -> Limits:
    """The limits of a generation of `world` ranks; `elastic`'s numbers replace derived values."""
    bound = compute_bound_s(spec, world, seen.peak_flops_per_rank)
    median = seen.median_step_s
    device = "gpu" if spec.resources.gpus_per_rank > 0 else "cpu"
    if seen.first_step_s is not None:
        first = max(MEASURED_FIRST_STEP_FLOOR_S[device], FIRST_STEP_REPEAT * seen.first_step_s)
    else:
        first = max(FIRST_STEP_FLOOR_S[device], FIRST_STEP_FACTOR * bound)
    limits = Limits(hang_floor_s=HANG_FLOOR_S, hang_factor=HANG_FACTOR, first_step_s=first,
                    collective_s=0.0, release_s=max(RELEASE_FLOOR_S, RELEASE_FACTOR * (median or bound)))
    if isinstance(elastic.hang_timeout_s, float | int):
        limits = replace(limits, hang_floor_s=float(elastic.hang_timeout_s), hang_factor=0.0)
    if isinstance(elastic.first_step_timeout_s, float | int):
        limits = replace(limits, first_step_s=float(elastic.first_step_timeout_s))
    if isinstance(elastic.release_timeout_s, float | int):
        limits = replace(limits, release_s=float(elastic.release_timeout_s))
    steady = max(limits.hang_floor_s, limits.hang_factor * (median or 0.0))
    collective = elastic.collective_timeout_s
    if not isinstance(collective, float | int):
        collective = max(COLLECTIVE_FLOOR_S, COLLECTIVE_FACTOR * max(steady, limits.first_step_s),
                         data_outage_s(spec) + steady)
    return replace(limits, collective_s=float(collective))



def restore_timeout_s(elastic, world: int, checkpoint_bytes: int | None, read_bytes_per_s: float | None,
                      join_s: float, retry_budget_s: float) -> float:
    """How long the controller waits for the ranks' restore. The retry budget is inside it, so a
    store that keeps failing ends as the ranks' TransientStorageError (the job fails naming the
    checkpoint), not as a timeout blamed on a rank."""
    if isinstance(elastic.restore_timeout_s, float | int):
        return float(elastic.restore_timeout_s)
    bandwidth = read_bytes_per_s or ASSUMED_READ_BPS_PER_RANK * world
    return join_s + BUILD_S + retry_budget_s + READ_FACTOR * (checkpoint_bytes or 0) / bandwidth


class Timeouts:
    """The limits in force, fed by the controller (see the module's protocol). `overrides`: values
    the caller fixes whatever the spec says (tests: `hang_floor_s`, `release_s`); `clock`: the
    monotonic clock that `record.progress_at` is of."""

    def __init__(self, spec, record, peak: Callable[[], float | None], log: Callable[[str], None], *,
                 join_s: float, retry_budget_s: float, clock: Callable[[], float] = time.monotonic,
                 **overrides: float):
        self.spec, self.record, self.peak, self.log, self.clock = spec, record, peak, log, clock
        self.join_s, self.retry_budget_s, self.overrides = join_s, retry_budget_s, overrides
        self.first_step_s: float | None = None
        self.read_bytes_per_s: float | None = None
        self._training_since: float | None = None  # record.progress_at when the generation started
        self._world = spec.world_size
        self._logged = ""

    def limits(self, world: int | None = None) -> Limits:
        seen = Observed(self.record.median_step_s(), self.first_step_s, self.peak(), self.read_bytes_per_s)
        return replace(derive(self.spec.elastic, self.spec, world or self._world, seen), **self.overrides)

    def for_generation(self, world: int) -> Limits:
        self._world, self._training_since = world, None  # (a failed generation's first step is over)
        limits = self.limits(world)
        explicit = isinstance(self.spec.elastic.restore_timeout_s, float | int)
        bandwidth = self.read_bytes_per_s or ASSUMED_READ_BPS_PER_RANK * world
        line = limits.line(f"{self.restore_s(world, None):.0f} s" + ("" if explicit else
                           f" + {READ_FACTOR:g} x checkpoint bytes / {bandwidth / 1e6:.0f} MB/s"))
        if line != self._logged:
            self._logged = line
            self.log(line)
        return limits

    def restore_s(self, world: int, checkpoint_bytes: int | None) -> float:
        return restore_timeout_s(self.spec.elastic, world, checkpoint_bytes, self.read_bytes_per_s, self.join_s,
                                 self.retry_budget_s)

    def checkpoint_bytes(self, step: int | None, read_manifest: Callable[[int], object]) -> int | None:
        """The size of checkpoint `step`: this run's commit record, else its manifest; None when unknown
        (a manifest that does not read is left for the ranks' restore to report)."""
        if step is None:
            return None
        known = [c.bytes for c in self.record.checkpoints if c.step == step]
        if known:
            return known[-1]
        try:
            return int(read_manifest(step).total_bytes)
        except Exception:
            return None

    def on_restored(self, results: list, seconds: float, from_storage: bool) -> None:
        read = sum(int(r.get("storage_read_bytes", 0)) for r in results if isinstance(r, dict))
        if from_storage and read and seconds > 0:
            self.read_bytes_per_s = read / seconds  # building the engine is inside: it errs low, so long

    def on_training_started(self) -> None:
        self._training_since = self.record.progress_at

    def hang_limit(self, saving_s: float = 0.0) -> tuple[float, str]:
        """The progress watchdog's limit now (a generation's first step gets the first-step limit) plus
        `saving_s` (a stop's save the ranks block on), and the spec field that sets it, which a hang's
        message names: a limit set below the step time is then found by its field."""
        limits = self.limits()
        # Until its first step, whatever progress came before: a validation owed at the restored step, after
        # which the first step's limit and measure count from the validation's end.
        pending = self._training_since is not None and not self.record.generation_stepped
        if pending and self.record.progress_at != self._training_since:
            self._training_since = self.record.progress_at
        if self._training_since is not None and not pending:  # the generation's first step came
            first = self.record.progress_at - self._training_since
            self.first_step_s = max(self.first_step_s or 0.0, first)
            self._training_since = None
        steady = hang_limit(self.record.median_step_s(), self.record.completed_steps(), self.spec,
                            limits.hang_floor_s, limits.hang_factor)
        if pending and limits.first_step_s > steady:
            return limits.first_step_s + saving_s, "elastic.first_step_timeout_s"
        return steady + saving_s, "elastic.hang_timeout_s"

    def release_s(self) -> float:
        """A survivor's time to leave. A survivor leaves at its next collective, and during a generation's
        first step that may come after minutes of compilation: until the first step's own limit runs out
        it is not hung, so the release waits that long (unless the spec, or a test, sets the release);
        killed, it would lose its warm caches and the memory snapshots it holds, and need a replacement."""
        limits = self.limits()
        fixed = isinstance(self.spec.elastic.release_timeout_s, float | int) or "release_s" in self.overrides
        if fixed or self._training_since is None or self.record.generation_stepped:
            return limits.release_s
        first_step_left = limits.first_step_s - (self.clock() - self._training_since)
        return max(limits.release_s, first_step_left)
