"""The hardware table: peak compute, memory, and links, per device kind.

GPU rows are the vendors' published figures for the SXM parts, dense (without the 2:4
sparsity that doubles NVIDIA's headline tensor numbers):

  H100 SXM5 80GB  NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 tensor 989.5 TFLOP/s dense
                  (1,979 with sparsity), FP32 67 TFLOP/s, HBM3 80GB at 3.35 TB/s, NVLink 4
                  900 GB/s per GPU (both directions together).
  H200 SXM 141GB  NVIDIA H200 Tensor Core GPU datasheet: same compute as H100 SXM, HBM3e 141GB
                  at 4.8 TB/s, NVLink 900 GB/s.
  A100 SXM4 80GB  NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 tensor 312 TFLOP/s dense
                  (624 with sparsity), FP32 19.5 TFLOP/s, HBM2e 80GB at 2,039 GB/s, NVLink 3
                  600 GB/s per GPU.

A running device is known by the name CUDA gives it (`named_peak`): besides the SXM parts above,
  H100 PCIe   NVIDIA H100 datasheet: BF16 tensor 756 TFLOP/s dense (1,513 with sparsity)
  H100 NVL    NVIDIA H100 NVL datasheet: 835 TFLOP/s dense (1,671 with sparsity)
  H200 NVL    NVIDIA H200 NVL datasheet: 835 TFLOP/s dense (1,671 with sparsity)
  L40S        NVIDIA L40S datasheet: 362.05 TFLOP/s dense (733 with sparsity)
  B200        NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense per GPU (4.5 with sparsity)
whose FP32 figures the table leaves out (their MFU at fp32 is unknown, never guessed).

The FP32 figure is the non-tensor-core one because torch runs fp32 matmuls in full fp32
unless TF32 is enabled (`torch.backends.cuda.matmul.allow_tf32` is False by default).
Vendor "GB" of HBM are binary (an H100 80GB shows 81559 MiB in nvidia-smi, an H200 143771
MiB), so capacities are taken as GiB; what the driver keeps for itself is in M_transient.
Link bandwidths are per GPU and per direction, the figure a ring collective sees: NVLink's
900 GB/s is 450 GB/s each way; inter-node is one InfiniBand NIC per GPU as in NVIDIA's DGX
H100/H200 (ConnectX-7 NDR, 400 Gb/s = 50 GB/s) and DGX A100 (ConnectX-6 HDR, 200 Gb/s =
25 GB/s). The per-hop latencies alpha are not vendor figures: they are NCCL's own model of a
ring step with the Simple protocol (NVIDIA/nccl src/graph/tuning.cc, `hwLat`: 3.4 us over
NVLink, 14 us over the network).

The CPU row is never made up: `cpu_hardware()` measures this machine (matmul peak, memory
copy bandwidth, loopback TCP for gloo). Measuring takes about a second, so callers (the
controller computing MFU on CPU, `undying plan --gpu cpu`) measure once and keep the result.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One device kind. Rates are per device: FLOP/s, bytes/s; latencies in seconds."""

    name: str
    kind: str  # "gpu" or "cpu"
    peak_flops: dict[str, float] = field(hash=False)  # by training precision: fp32, bf16, fp16
    hbm_bytes: int
    hbm_bandwidth: float
    intra_bandwidth: float  # to a device of the same node, one direction
    inter_bandwidth: float  # to a device of another node, one direction
    intra_alpha: float  # latency of one ring step inside a node
    inter_alpha: float  # latency of one ring step across nodes
    devices_per_node: int
    threads: int = 0  # CPU only: torch threads of the measurement (0 for GPUs)

    def host_share(self, ranks: int) -> float:
        """Fraction of a measured CPU row's rates one of `ranks` ranks on the host gets: they
        share its cores, each running at most `threads` threads. 1 for GPUs (one rank each)."""
        if self.kind != "cpu":
            return 1.0
        return min(1.0, self.devices_per_node / (ranks * self.threads))

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ValueError(f"{self.name} has no peak for precision {precision!r}: "
                             f"known {sorted(self.peak_flops)}")
        return self.peak_flops[precision]

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "peak_flops": dict(self.peak_flops),
                "hbm_bytes": self.hbm_bytes, "hbm_bandwidth": self.hbm_bandwidth,
                "intra_bandwidth": self.intra_bandwidth, "inter_bandwidth": self.inter_bandwidth,
                "intra_alpha": self.intra_alpha, "inter_alpha": self.inter_alpha,
                "devices_per_node": self.devices_per_node, "threads": self.threads}


def _gpu(name: str, tensor: float, fp32: float, hbm_gib: int, hbm_bw: float, nvlink: float,
         nic: float) -> Hardware:
    return Hardware(name=name, kind="gpu", peak_flops={"bf16": tensor, "fp16": tensor, "fp32": fp32},
                    hbm_bytes=hbm_gib * GiB, hbm_bandwidth=hbm_bw, intra_bandwidth=nvlink / 2,
                    inter_bandwidth=nic, intra_alpha=3.4e-6, inter_alpha=14e-6, devices_per_node=8)


# Figures and sources: module docstring.
GPUS: dict[str, Hardware] = {
    "h100": _gpu("H100 SXM 80GB", 989.5e12, 67e12, 80, 3.35e12, 900e9, 50e9),
    "h200": _gpu("H200 SXM 141GB", 989.5e12, 67e12, 141, 4.8e12, 900e9, 50e9),
    "a100": _gpu("A100 SXM 80GB", 312e12, 19.5e12, 80, 2.039e12, 600e9, 25e9),
}
DEVICE_NAMES = (*GPUS, "cpu")
# Device-name fragment -> (dense bf16 FLOP/s, the GPUS row of the part, if it is one). The first
# fragment in the name wins, so a variant ("H100 PCIe") comes before the part it shares a name with
# ("H100"); "GH200" contains "H200" and has the same Hopper compute. Sources: module docstring.
NAMED_GPUS: tuple[tuple[str, float, str | None], ...] = (
    ("H100 PCIe", 756e12, None),
    ("H100 NVL", 835e12, None),
    ("H200 NVL", 835e12, None),
    ("H200", GPUS["h200"].peak("bf16"), "h200"),
    ("H100", GPUS["h100"].peak("bf16"), "h100"),
    ("A100", GPUS["a100"].peak("bf16"), "a100"),
    ("L40S", 362.05e12, None),
    ("B200", 2250e12, None),
)


def named_peak(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s at `precision` of the device CUDA calls `device_name` ("NVIDIA H100
    PCIe"), or None when the table does not know it (MFU is then unknown, never guessed)."""
    found = next((row for row in NAMED_GPUS if row[0].lower() in device_name.lower()), None)
    if found is None:
        return None
    _, tensor_peak, part = found
    if precision in ("bf16", "fp16"):
        return tensor_peak
    return GPUS[part].peak(precision) if part is not None else None


def hardware(name: str, precisions: tuple[str, ...] = ("fp32",)) -> Hardware:
    """The table row for `name` (h100, h200, a100), or this machine measured for "cpu"
    (`precisions` says which matmul peaks to measure; GPU rows have them all)."""
    key = name.lower()
    if key in GPUS:
        return GPUS[key]
    if key == "cpu":
        return cpu_hardware(precisions)
    raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_NAMES)}")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_cpu_matmul_flops(seconds: float = 0.5, precision: str = "fp32", n: int = 1024) -> float:
    """Best matmul rate (FLOP/s) of this CPU over about `seconds`, at torch's current thread count.

    Peak means the best sustained rate, so the fastest of repeated timed batches counts
    (a square n x n matmul is 2 n^3 FLOPs). The first call is a warm-up: it allocates and
    lets the BLAS pick its kernel.
    """
    dtype = _DTYPES[precision]
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b, out=out)
        elapsed = time.perf_counter() - started
        best = max(best, 3 * 2 * n**3 / elapsed)
        if time.perf_counter() >= deadline:
            return best


def measure_cpu_memory_bandwidth(seconds: float = 0.2, size_bytes: int = 64 << 20) -> float:
    """Best copy bandwidth (bytes/s): a copy of S bytes reads S and writes S."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * size_bytes / (time.perf_counter() - started))
        if time.perf_counter() >= deadline:
            return best


def measure_loopback_link(size_bytes: int = 32 << 20, pings: int = 200) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of TCP over loopback, the transport gloo uses on one host.

    Bandwidth: one stream of `size_bytes`. Alpha: half of a 1-byte round trip, measured from
    Python, so an upper bound on what gloo's C++ loop sees.
    """
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    server.close()
    try:
        for s in (sender, receiver):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunks = size_bytes >> 20

        def send() -> None:
            chunk = bytes(1 << 20)
            for _ in range(chunks):
                sender.sendall(chunk)

        thread = threading.Thread(target=send, daemon=True)
        buffer, received = bytearray(1 << 20), 0
        started = time.perf_counter()
        thread.start()
        while received < chunks << 20:
            received += receiver.recv_into(buffer)
        bandwidth = received / (time.perf_counter() - started)
        thread.join()
        started = time.perf_counter()
        for _ in range(pings):
            sender.sendall(b"x")
            receiver.recv(1)
            receiver.sendall(b"y")
            sender.recv(1)
        alpha = (time.perf_counter() - started) / pings / 2
    finally:
        sender.close()
        receiver.close()
    return alpha, bandwidth


def cpu_hardware(precisions: tuple[str, ...] = ("fp32",), seconds: float = 0.5) -> Hardware:
    """This machine as a `Hardware` row, every figure measured now (about `seconds` per
    precision plus half a second). All ranks of a CPU job share one host, so every link is
    the loopback one and the "node" holds one rank per core."""
    peaks = {p: measure_cpu_matmul_flops(seconds, p) for p in precisions}
    alpha, link = measure_loopback_link()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name=f"CPU ({torch.get_num_threads()} threads, measured)", kind="cpu", peak_flops=peaks,
                    hbm_bytes=ram, hbm_bandwidth=measure_cpu_memory_bandwidth(), intra_bandwidth=link,
                    inter_bandwidth=link, intra_alpha=alpha, inter_alpha=alpha,
                    devices_per_node=os.cpu_count() or 1, threads=torch.get_num_threads())
