"""Dense bf16 peaks of known GPUs and the MFU arithmetic of the GPU check.

MFU (model FLOPs utilisation, PaLM appendix B) is the model's training FLOPs per token times
the tokens per second, over the device's peak: `trainer.model.flops_per_token` counts 6 FLOPs
per matmul weight and 12 L h s for attention, and never the recomputed forward (that would
be hardware FLOPs utilisation), so a run with recomputation shows a lower MFU for the same
kernels. The peak is the vendor's dense figure (without 2:4 sparsity, which doubles NVIDIA's
headline tensor numbers). H100 SXM, H200 and A100 come from the cost model's hardware table
(`trainer.costmodel.hardware.GPUS`, sources in its docstring) so the two never disagree; the
others are the vendors' datasheets:

  H100 PCIe   NVIDIA H100 datasheet: BF16 tensor 756 TFLOP/s dense (1,513 with sparsity)
  H100 NVL    NVIDIA H100 NVL datasheet: 835 TFLOP/s dense (1,671 with sparsity)
  L40S        NVIDIA L40S datasheet: 362.05 TFLOP/s dense (733 with sparsity)
  B200        NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense per GPU (4.5 with sparsity)

A device not in the table has no peak: its MFU is reported as unknown, never guessed.
"""

from __future__ import annotations

import time

import torch

from trainer.costmodel.hardware import GPUS

# Device-name fragment -> dense bf16 FLOP/s. Order matters: the first fragment found in the
# name wins, so a variant ("H100 PCIe") comes before the part it shares a name with ("H100");
# "GH200" contains "H200" and has the same Hopper compute.
KNOWN_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", GPUS["h200"].peak("bf16")),
    ("H100", GPUS["h100"].peak("bf16")),
    ("A100", GPUS["a100"].peak("bf16")),
    ("L40S", 362.05e12),
    ("B200", 2250e12),
)


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak in FLOP/s of the device `torch.cuda.get_device_name()` calls
    `device_name` ("NVIDIA H200"), or None for a device the table does not know."""
    return next((peak for fragment, peak in KNOWN_BF16_PEAKS if fragment.lower() in device_name.lower()), None)


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
