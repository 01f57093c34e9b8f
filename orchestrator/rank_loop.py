"""A rank's autonomous training loop: steps, reports, checkpoint saves.

Runs inside `RankActor.train` on the actor's training thread. Per step it talks to nobody
but its process group; to the controller it sends, through the store:
  * rank 0 only: one `step` event per step with the global (already all-reduced) loss,
    so the controller's per-step traffic does not grow with the number of ranks;
  * every rank: a heartbeat key, at most every `monitor.heartbeat_s`, when it also picks
    up a new checkpoint plan;
  * every rank: a `receipt` event when its shard of a checkpoint is durable.
"""

from __future__ import annotations

import threading
import time

from chaos.injector import FaultInjector
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from orchestrator.ckpt_plan import CheckpointPlan
from orchestrator.rendezvous import PLAN, GenerationStore, heartbeat_key


def plan_from_store(store: GenerationStore, current: CheckpointPlan) -> CheckpointPlan:
    data = store.get_json(PLAN)
    if data is None or data.get("version", -1) <= current.version:
        return current
    return CheckpointPlan.from_json(data)


def write_heartbeat(store: GenerationStore, rank: int, step: int, compute_s: float) -> None:
    """`compute_s`: the rank's mean step compute time since its previous heartbeat."""
    store.set_json(heartbeat_key(rank), {"step": step, "time": time.time(), "compute_s": compute_s})


class RankLoop:
    def __init__(self, spec, engine, store: GenerationStore, rank: int, world_size: int,
                 abort: threading.Event, baseline_bytes: int = 0):
        self.spec = spec
        self.engine = engine
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.abort = abort
        self.baseline_bytes = baseline_bytes

    def _on_receipt(self, receipt, extra: dict) -> None:
        self.store.push_event({"type": "receipt", "receipt": receipt.model_dump(), "extra": extra})

    def _on_save_error(self, step: int, err: BaseException) -> None:
        self.store.push_event({"type": "save_error", "rank": self.rank, "step": step,
                               "error": f"{type(err).__name__}: {err}"})

    def _step_event(self, result) -> dict:
        return {"type": "step", "step": result.step, "loss": result.loss, "tokens": result.tokens,
                "grad_norm": result.grad_norm, "lr": result.lr, "step_s": result.step_s,
                "compute_s": result.compute_s, "time": time.time()}

    def _report_memory(self) -> None:
        """Rank 0, once per generation after its first step: measured memory by ledger."""
        from trainer.memory_probe import measure

        self.store.push_event({"type": "memory", "ledgers": measure(self.engine, self.baseline_bytes)})

    def run(self, until_step: int, faults: list[dict]) -> dict:
        plan = plan_from_store(self.store, CheckpointPlan(every=10**9, version=-1))
        hook = FaultInjector.hook_for(faults, self.rank, self.store.push_event)
        self.engine.fault_hook = hook
        storage = Storage(self.spec.checkpoint_root, self.spec.checkpoint.storage_options)
        writer = ShardWriter(storage, self.rank, self._on_receipt, self._on_save_error,
                             async_save=self.spec.checkpoint.async_, fault_hook=hook, tag=plan.tag)
        heartbeat_s = self.spec.monitor.heartbeat_s
        last_beat, compute, steps_in_beat, first = 0.0, 0.0, 0, True
        try:
            while self.engine.next_step < until_step:
                if self.abort.is_set():
                    return {"status": "aborted", "rank": self.rank, "step": self.engine.next_step,
                            "error": "abort requested by the controller"}
                result = self.engine.train_step()
                if self.rank == 0:
                    self.store.push_event(self._step_event(result))
                    if first:
                        self._report_memory()
                first = False
                compute, steps_in_beat = compute + result.compute_s, steps_in_beat + 1
                now = time.monotonic()
                if now - last_beat >= heartbeat_s:
                    write_heartbeat(self.store, self.rank, result.step, compute / steps_in_beat)
                    compute, steps_in_beat = 0.0, 0
                    plan = plan_from_store(self.store, plan)
                    last_beat = now
                completed = self.engine.next_step
                if plan.should_save(completed):
                    extra = {"engine": self.engine.state_meta()} if self.rank == 0 else {}
                    writer.save(completed, self.engine.state_slices(), extra)
        finally:
            writer.flush()  # a save started before an error still lands; it commits only if complete
        return {"status": "done", "rank": self.rank, "step": self.engine.next_step,
                "ckpt_waits": writer.waited}
