"""Dense bf16 peaks of known GPUs and the MFU arithmetic of the GPU check.

MFU (model FLOPs utilisation, PaLM appendix B) is the model's training FLOPs per token times
the tokens per second, over the device's peak: `trainer.model.flops_per_token` counts 6 FLOPs
per matmul weight and 12 L h s for attention, and never the recomputed forward (that would
be hardware FLOPs utilisation), so a run with recomputation shows a lower MFU for the same
kernels. The peak is the vendor's dense figure (without 2:4 sparsity, which doubles NVIDIA's
headline tensor numbers), from the table the ranks' own MFU uses (`trainer.costmodel.hardware.
named_peak`, sources in its docstring). A device not in the table has no peak: its MFU is
reported as unknown, never guessed.
"""

from __future__ import annotations

import time

import torch

from trainer.costmodel.hardware import named_peak


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of the device `torch.cuda.get_device_name()` calls
    `device_name` ("NVIDIA H200"), or None for a device the table does not know."""
    return named_peak(device_name, "bf16")


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s over `peak` (a fraction), or None when the peak is unknown."""
    if peak is None:
        return None
    if peak <= 0:
        raise ValueError(f"peak {peak} FLOP/s must be positive")
    return tokens_per_s * flops_per_token / peak


def measured_matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """bf16 TFLOP/s of an n x n GEMM: the best this device does on the simplest kernel."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12
