"""Device-to-host checkpoint staging on one GPU: the copy engine's ceiling and the writers' rates.

Protocol: the main process calls these in turn on cuda:0 with nothing else on the device.

  pinned_copy       the anchor: one device buffer copied into one pinned host buffer with a
                    non-blocking copy, best of several; the most any staging can reach here.
  staging_check     `ckpt.staging.StagingPool` (the in-process writer): device tensors staged
                    into pinned buffers kept from one save to the next; exact, pinned, and the
                    warm save's GB/s.
  process_writer_check
                    `ckpt.process_writer.ProcessShardWriter` (the default writer on object
                    stores): a memfd buffer page-locked for CUDA; the warm save's blocking time,
                    pinned, and the shard loaded back equal to the device tensors.
"""

from __future__ import annotations

import tempfile
import time

import torch

from trainer.state_slices import whole


def _pieces(mib: int) -> list:
    return [whole(f"w{i}", torch.randn(1 << 20, 16, device="cuda")) for i in range(mib // 64)]


def pinned_copy(mib: int = 1024, repeats: int = 5) -> dict:
    """GB/s of a device -> pinned host copy of `mib` MiB (best of `repeats`)."""
    source = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    target = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return {"mib": mib, "seconds": best, "gbps": (mib << 20) / best / 1e9}


def staging_check(mib: int = 1024, saves: int = 3) -> dict:
    """The in-process writer's staging of device state: pinned host buffers, exact copies, GB/s."""
    from ckpt.staging import StagingPool

    pieces = _pieces(mib)
    pool, times = StagingPool(), []
    for _ in range(saves):  # the first save allocates (pins) the buffers, later ones reuse them
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged = pool.stage(pieces)
        times.append(time.perf_counter() - start)
    exact = all(torch.equal(s.tensor, p.tensor.cpu()) for s, p in zip(staged, pieces, strict=True))
    pinned = all(s.tensor.is_pinned() for s in staged)
    return {"mib": mib, "first_s": times[0], "warm_s": min(times[1:]), "gbps": (mib << 20) / min(times[1:]) / 1e9,
            "exact": exact, "pinned": pinned, "ok": exact and pinned}


def process_writer_check(mib: int = 1024, saves: int = 3) -> dict:
    """The writer process's staging of device state; then the child's shards, loaded back, must
    equal the device tensors."""
    from ckpt.catalog import Catalog
    from ckpt.process_writer import ProcessShardWriter
    from ckpt.reader import load_checkpoint
    from ckpt.storage import Storage

    pieces = _pieces(mib)
    receipts, errors, blocking = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/job"
        writer = ProcessShardWriter(url, {}, 0, lambda r, extra: receipts.append(r),
                                    lambda step, err: errors.append(f"{step}: {err}"))
        for step in range(1, saves + 1):
            torch.cuda.synchronize()
            blocking.append(writer.save(step, pieces, {}))
            writer.wait()
        pinned = writer._buffer.pinned
        writer.flush()
        exact = False
        if not errors:
            catalog = Catalog(Storage(url))
            catalog.commit(job="j", step=saves, generation=0, layout={}, spec_hash="h",
                           receipts=[receipts[-1]], state={})
            tensors, _ = load_checkpoint(catalog, saves)
            exact = all(torch.equal(tensors[p.name], p.tensor.cpu()) for p in pieces)
    warm = min(blocking[1:])
    return {"mib": mib, "first_s": blocking[0], "warm_s": warm, "gbps": (mib << 20) / warm / 1e9, "pinned": pinned,
            "exact": exact, "errors": errors, "ok": exact and pinned and not errors}

