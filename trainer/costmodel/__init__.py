"""The cost model: memory per rank and step time of a parallel layout, from first principles.

    layout.py    Workload (what is trained) and Layout (how it is cut); parameters per stage
    hardware.py  peak FLOP/s, HBM, links per device kind; the CPU row measured
    memory.py    the four ledgers: state, activation, collective, transient
    time.py      the step-time bound, ring collectives, pipeline bubbles
    planner.py   every layout for N devices, rejected with reasons or ranked by step time
    metrics.py   predictions for a spec's own layout, for the controller's metrics

The formulas are docs/design.md section 1's; the tests use them as oracles.
"""

from trainer.costmodel.hardware import GPUS, Hardware, cpu_hardware, hardware, measure_cpu_matmul_flops
from trainer.costmodel.layout import Layout, Workload, stage_params
from trainer.costmodel.memory import Ledgers, ledgers, zero_state_bytes
from trainer.costmodel.metrics import predicted_bubble_ratio, predicted_ledgers
from trainer.costmodel.planner import Plan, plan
from trainer.costmodel.time import Prediction, bubble_fraction, predict, predict_step, ring_allreduce_seconds

__all__ = [
    "GPUS", "Hardware", "Layout", "Ledgers", "Plan", "Prediction", "Workload", "bubble_fraction",
    "cpu_hardware", "hardware", "ledgers", "measure_cpu_matmul_flops", "plan", "predict", "predict_step",
    "predicted_bubble_ratio", "predicted_ledgers", "ring_allreduce_seconds", "stage_params",
    "zero_state_bytes",
]
