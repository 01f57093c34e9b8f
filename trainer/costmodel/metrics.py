"""Predictions for a job's own layout, exported beside the measured values as metrics.

Protocol: the controller calls these once per spec (they are pure and cost microseconds) and
publishes the numbers next to what the ranks measure, so a dashboard shows predicted vs
measured memory per ledger and predicted vs measured bubble. No device is measured here.
"""

from __future__ import annotations

from typing import Any

from trainer.costmodel.layout import Layout, Workload
from trainer.costmodel.memory import ledgers
from trainer.costmodel.time import bubble_fraction


def device_kind(spec: Any) -> str:
    """"gpu" when the spec's ranks ask Ray for GPUs, else "cpu"."""
    return "gpu" if spec.resources.gpus_per_rank > 0 else "cpu"


def predicted_ledgers(spec: Any) -> dict[str, int]:
    """Bytes per ledger (state, activation, collective, transient) of the spec's most loaded
    rank, for its own layout and device kind (docs/design.md section 1)."""
    memory = ledgers(Workload.from_spec(spec), Layout.from_spec(spec), device_kind(spec))
    return {"state": memory.state, "activation": memory.activation, "collective": memory.collective,
            "transient": memory.transient}


def predicted_bubble_ratio(spec: Any) -> float:
    """Idle fraction of a pipeline step for the spec's schedule: (p-1)/(m+p-1) for GPipe and
    1F1B, m the microbatches per step of one pipeline (see `time.bubble_fraction`)."""
    layout = Layout.from_spec(spec)
    m = layout.microbatches(spec.train.global_batch)
    return bubble_fraction(layout.schedule, layout.pp, m, layout.virtual_stages)
