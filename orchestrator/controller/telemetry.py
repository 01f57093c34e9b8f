"""The controller's view of rank health and efficiency: heartbeats, stragglers, MFU, memory.

Protocol (controller thread only):
  * `on_layout(spec, dp, gen)` at every new generation: predicted memory ledgers and pipeline
    bubble are exported for the new layout; straggler history is reset (ranks renumber).
  * `on_restored(results)` with the ranks' `restore` results: rank 0 reports its device's
    peak FLOP/s (table value on GPUs, measured matmul peak on CPUs) for MFU; a NaN peak (a GPU
    the table does not know) leaves MFU unknown.
  * `mfu(tokens, step_s)` per step record.
  * `poll(store, world_size)` from the RUNNING and STOPPING loops; reads every rank's heartbeat
    at most once per heartbeat period, feeds the straggler detector and exports per-rank compute
    and straggler flags and ratios, and feeds `saves` (orchestrator.controller.save_watch: ranks blocked on a
    checkpoint save or waiting out their data store, for the hang watchdog). Returns ranks newly
    flagged; `stragglers(...)` wraps it for the training loop (record, log, the ranks to evict).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from monitor.report import StragglerRecord
from monitor.straggler import StragglerDetector
from orchestrator.controller.save_watch import SaveWatch, data_outage_s
from orchestrator.wire.messages import Heartbeat
from orchestrator.wire.store import heartbeat_key

log = logging.getLogger(__name__)


def slowest_restore(results: list) -> str:
    """", slowest rank R: engine A s, load B s" for the rank whose restore took longest (the ranks'
    `restore` answers), for the controller's RESTORING -> RUNNING line; "" when they carry no times."""
    timed = [r for r in results if isinstance(r, dict) and "build_s" in r]
    if not timed:
        return ""
    worst = max(timed, key=lambda r: r["seconds"])
    return f" (slowest rank {worst['rank']}: engine {worst['build_s']:.2f} s, load {worst['load_s']:.2f} s)"


class Telemetry:
    def __init__(self, spec, metrics, heartbeat_s: float):
        from trainer.model import flops_per_token

        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.flops_per_token = flops_per_token(spec.model, spec.data.seq_len)
        self.peak_flops_per_rank: float | None = None
        self.world_size = spec.world_size
        self.detector = StragglerDetector()
        self.saves = SaveWatch(data_outage_s(spec))
        self._last_poll = 0.0
        self._seen: dict[int, float] = {}
        self._unparsed: set[int] = set()  # ranks whose heartbeat did not parse (logged once each)

    def on_layout(self, spec, dp: int) -> None:
        from trainer.costmodel.metrics import predicted_bubble_ratio, predicted_ledgers

        now = spec.model_copy(update={"parallel": spec.parallel.with_dp(dp)})
        self.world_size = now.world_size
        self.metrics.on_memory("predicted", predicted_ledgers(now))
        self.metrics.on_bubble(predicted_bubble_ratio(now))
        self.detector.reset()
        tp, pp = spec.parallel.tp, spec.parallel.pp
        self.detector.peer_group = lambda rank: (rank // tp) % pp  # its pipeline stage (trainer.topology)
        self.saves.reset()
        self._seen.clear()

    def on_restored(self, results: list[dict]) -> None:
        peak = next((r["peak_flops"] for r in results if "peak_flops" in r), None)
        if peak and math.isfinite(peak):  # NaN: a device whose peak is not known, MFU not guessed
            self.peak_flops_per_rank = peak

    def mfu(self, tokens: int, step_s: float) -> float | None:
        if not self.peak_flops_per_rank or step_s <= 0:
            return None
        return tokens / step_s * self.flops_per_token / (self.peak_flops_per_rank * self.world_size)

    def poll(self, store, world_size: int) -> set[int]:
        now = time.monotonic()
        if now - self._last_poll < self.heartbeat_s:
            return set()
        self._last_poll = now
        beats = store.get_many_json([heartbeat_key(rank) for rank in range(world_size)])
        for rank, data in enumerate(beats):
            beat = _beat(rank, data, self._unparsed)
            if beat is not None:
                self.saves.observe(rank, beat, now)
            # A beat while blocked on a save, or waiting for data, repeats the last step's compute time
            # (none before a first step): not a new sample.
            if beat is None or beat.saving is not None or beat.data_wait_s > 0 or self._seen.get(rank) == beat.time:
                continue
            self._seen[rank] = beat.time
            self.detector.observe(rank, beat.compute_s)
            self.metrics.on_rank_compute(rank, beat.compute_s)
        flagged, newly = self.detector.evaluate(now)
        self.metrics.on_stragglers(flagged, self.detector.last_ratios)
        return newly

    def stragglers(self, store, world_size: int, record, log, evict: bool,
                   spare: Callable[[], object] = lambda: True) -> list[int]:
        """Each poll of training: newly flagged sustained stragglers go into the job record and
        the log; returns the ranks to evict (`elastic.evict_stragglers`), only while a warm spare
        can take one over (`spare()`, asked only then): a new actor would start in the evicted
        rank's own seat, on the same (slow) device, and be evicted again until the restart budget
        ran out."""
        newly = sorted(self.poll(store, world_size))
        evicts = evict and bool(newly) and bool(spare())
        how = ("; evicting it" if evicts else "; not evicted: no warm spare to take it over (a new actor would "
               "start on the same device)") if evict else ""
        for rank in newly:
            ratio = self.detector.last_ratios.get(rank, float("nan"))
            record.stragglers.append(StragglerRecord(time=record.job_seconds(), rank=rank, ratio=ratio))
            log(f"straggler: rank {rank} computes {ratio:.2f}x its peers' median for "
                f"{self.detector.sustain_s:.0f} s{how}")
        return newly if evicts else []


def _beat(rank: int, data, unparsed: set[int]) -> Heartbeat | None:
    """Rank `rank`'s heartbeat, None when it has none or one that does not parse (another release's, a
    bug's: logged once per rank in `unparsed`; the hang watchdog then judges the rank by its last good one)."""
    if data is None:
        return None
    try:
        return Heartbeat.from_json(data)
    except ValueError as err:
        if rank not in unparsed:
            unparsed.add(rank)
            log.error("ignoring rank %d's heartbeats, which do not parse (%s): %s", rank, err, data)
        return None
