"""The device a rank computes on: which one, whether it is usable, and its peak FLOP/s for MFU.

Called by the rank actor (orchestrator.rank.actor) as it warms up, joins and restores.
"""

from __future__ import annotations

import os


def torch_device(spec):
    import torch

    return torch.device("cuda" if spec.resources.gpus_per_rank > 0 else "cpu")


_PEAK_FLOPS: dict[str, float] = {}


def peak_flops_per_rank(spec, device) -> float:
    """Peak FLOP/s of one rank's device, for MFU: the vendor's dense figure on GPUs, a measured
    matmul peak on CPUs (cached per process; measured once, at this process's first restore)."""
    from trainer.costmodel.hardware import measure_cpu_matmul_flops, named_peak

    precision = spec.train.precision
    key = f"{device.type}:{precision}"
    if key not in _PEAK_FLOPS:
        if device.type == "cuda":
            import torch

            peak = named_peak(torch.cuda.get_device_name(device), precision)
            _PEAK_FLOPS[key] = float("nan") if peak is None else peak
        else:
            _PEAK_FLOPS[key] = measure_cpu_matmul_flops(0.3, precision)
    return _PEAK_FLOPS[key]


def require_cuda(gpus_per_rank: float) -> None:
    """A GPU rank's device is usable, or a RuntimeError that says why in words naming the fix: on a
    node whose NVIDIA driver is older than this torch's CUDA needs, every rank fails here, at its
    first CUDA call, and the error must say so rather than a bare CUDA message."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        torch.cuda.init()  # its error says why: no driver, a driver too old, no device
        why = "torch.cuda.is_available() is False"
    except Exception as err:  # noqa: BLE001 (torch raises several kinds here)
        why = f"{type(err).__name__}: {err}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    raise RuntimeError(f"resources.gpus_per_rank = {gpus_per_rank:g}, but this rank sees no usable CUDA device "
                       f"({why}); torch {torch.__version__} is built for CUDA {torch.version.cuda}: the node's "
                       "NVIDIA driver must support it (CUDA 13.0: driver release 580 or newer; `nvidia-smi`), and "
                       f"Ray must give the rank a GPU (CUDA_VISIBLE_DEVICES={visible!r})")
