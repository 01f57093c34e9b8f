"""The timed operations of bench.ckpt, run on every rank of the worker group (bench/ckpt/worker.py).

Each operation starts after a barrier on the training group and stops its clocks before any
other collective: barriers, `all_gather_object` of the timings and the bit checks are
outside the timed regions. Every rank returns its own timestamps (`time.time()`, one clock
for all processes of this machine); the driver reduces them (bench/ckpt/report.py):
blocking = the worst rank's, total = last rank done - first rank started.

Our save follows the production protocol: `ShardWriter.save` on each rank, the receipt
sent from the writer thread through a side channel (a TCPStore the driver hosts, never a
collective on the training group, docs/design.md invariant 5) to the driver, which merges the
receipts and commits the manifest with ckpt.commit.Committer, as the controller
does, and publishes the commit time under `commit/<step>`. The rank waits for that key
(the store releases the GIL while it waits) to learn when its save became a checkpoint.

Both systems are timed warm, as in a training job that has saved before: our writers are
created once per storage and mode and share one staging pool (`ckpt.staging.StagingPool`)
that the untimed warm-up fills; DCP's `async_save` gets one `DefaultStager` for the run,
whose cached host copy the warm-up fills (without it every `async_save` would build a
fresh stager and allocate a new copy).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from bench.ckpt.state import BenchState
from ckpt.catalog import Catalog
from ckpt.manifest import ShardReceipt, step_dir
from ckpt.reader import read_slices
from ckpt.reshard import plan_reads
from ckpt.shards import slices_to_write
from ckpt.staging import StagingPool
from ckpt.storage import Storage
from ckpt.writer import ShardWriter

STORE_TIMEOUT = timedelta(minutes=30)
SETTLE_S = 1.0  # pause before every timed save, after os.sync (see RankOps.settle)


def plan(backends: list[str], repeats: int, layouts: list[str]) -> list[dict]:
    """Every operation in order, the same list on the driver and every rank.

    Systems alternate inside each repeat, and the order rotates from one repeat to the next
    (saves by one place, loads swap who goes first), so drift on a shared machine and
    first-in-a-row effects (a storage server growing its volumes) do not fall on one system.
    Our saves get increasing step numbers in execution order (the committer ignores a step at
    or below its latest). The raw read is last: after it the repeat's checkpoints are deleted.
    """
    saves = ["ours_async", "ours_sync", "dcp_save", "dcp_async"]
    ops, step = [], 0
    for backend in backends:
        for rep in range(repeats):
            for kind in saves[rep % len(saves):] + saves[:rep % len(saves)]:
                op = {"backend": backend, "rep": rep, "op": kind}
                if kind.startswith("ours"):
                    step += 1
                    op["step"] = step
                ops.append(op)
            for layout in layouts:
                pair = ["ours_load", "dcp_load"] if rep % 2 == 0 else ["dcp_load", "ours_load"]
                ops += [{"backend": backend, "rep": rep, "op": kind, "layout": layout} for kind in pair]
            ops.append({"backend": backend, "rep": rep, "op": "raw_read"})
    return ops


@dataclass
class Backend:
    """Where one storage kind keeps this run's checkpoints (built by the driver, sent as JSON)."""

    name: str
    ours: str  # our checkpoint root URL (one step directory per save)
    dcp: str  # DCP checkpoints go to <dcp>/<save id>: a path for file://, a URL for s3://
    options: dict = field(default_factory=dict)

    def dcp_writer(self, path: str):
        if self.name == "file":
            return FileSystemWriter(path)
        return FsspecWriter(path, **self.options)  # the kwargs reach fsspec's url_to_fs

    def dcp_reader(self, path: str):
        return FileSystemReader(path) if self.name == "file" else FsspecReader(path, **self.options)


class RankOps:
    """One rank's side of every operation in `plan`."""

    def __init__(self, state: BenchState, backends: dict[str, Backend], store_host: str, store_port: int):
        self.state = state
        self.rank = state.rank
        self.backends = backends
        # Two clients: the writer thread sends receipts while the main thread waits on another key.
        self.sender = dist.TCPStore(store_host, store_port, is_master=False, timeout=STORE_TIMEOUT)
        self.waiter = dist.TCPStore(store_host, store_port, is_master=False, timeout=STORE_TIMEOUT)
        self.storages = {name: Storage(b.ours, b.options) for name, b in backends.items()}
        self.slices = state.our_slices()
        self.dcp_state = state.dcp_state()
        self.errors: list[str] = []
        self.shard_file: dict[str, str] = {}  # backend -> this rank's shard file of the last save
        # One pool for all writers: each save is written before the next starts (as the one
        # writer of a training rank would be), so they never stage at the same time.
        self.staging = StagingPool()
        self.writers: dict[tuple[str, str], ShardWriter] = {}
        # CPU training: no pinned or shared memory, staging on the calling thread (the
        # options that need an accelerator are off).
        self.dcp_stager = DefaultStager(StagingOptions(False, False, False, False))

    def warm_up(self) -> None:
        """Untimed: open every storage client once (connection pools, fsspec's cached instance that
        DCP's fsspec writer and reader reuse), as a training job has long done before a save."""
        for name, backend in self.backends.items():
            storage = self.storages[name]
            path = storage.path(".warm", f"r{self.rank}")
            storage.write_immutable(path, b"warm")
            storage.read(path)
            storage.remove(path)
            if name != "file":
                fs, root = url_to_fs(backend.dcp, **backend.options)
                fs.pipe_file(f"{root}/.warm-r{self.rank}", b"warm")
                fs.rm_file(f"{root}/.warm-r{self.rank}")
        # The host copies both systems keep between saves.
        self.staging.stage(slices_to_write(self.slices))
        self.dcp_stager.stage(self.dcp_state)
        dist.barrier()

    # -- saves -----------------------------------------------------------------------------

    def _on_receipt(self, backend: str):
        def send(receipt: ShardReceipt, extra: dict) -> None:
            self.shard_file[backend] = receipt.file
            event = {"backend": backend, "receipt": receipt.model_dump(mode="json"), "extra": extra}
            self.sender.set(f"receipt/{receipt.step}/{receipt.rank}", json.dumps(event))
        return send

    def _on_error(self, step: int, err: BaseException) -> None:
        self.errors.append(f"step {step}: {type(err).__name__}: {err}")
        self.sender.set(f"error/{step}/{self.rank}", repr(err))

    def settle(self) -> None:
        """Before every timed save (untimed): flush what earlier operations left dirty, then pause.

        Four 1 GiB saves in a row on one disk (and a virtual disk's host cache behind it) make
        whichever comes next wait for the previous one's writeback; a training job saves
        minutes apart. `os.sync` plus a pause starts every save, of either system, on a quiet disk.
        """
        if self.rank == 0:
            os.sync()
            time.sleep(SETTLE_S)

    def ours_save(self, op: dict) -> dict:
        backend, step = op["backend"], op["step"]
        writer = self.writers.get((backend, op["op"]))
        if writer is None:
            writer = ShardWriter(self.storages[backend], self.rank, self._on_receipt(backend), self._on_error,
                                 async_save=op["op"] == "ours_async", staging=self.staging)
            self.writers[(backend, op["op"])] = writer
        extra = {"engine": {"bench": "ckpt", "step": step}} if self.rank == 0 else {}
        self.settle()
        dist.barrier()
        start = time.time()
        blocking = writer.save(step, self.slices, extra)
        returned = time.time()
        self.waiter.wait([f"commit/{step}"])
        commit = json.loads(self.waiter.get(f"commit/{step}"))
        writer.wait()  # the thread stays, as a training rank's writer does from one save to the next
        if not commit["ok"]:
            raise RuntimeError(f"step {step} was not committed: {commit['why']}")
        return {"start": start, "returned": returned, "blocking": blocking, "end": commit["committed_at"],
                "nbytes": commit["nbytes"]}

    def dcp_save(self, op: dict) -> dict:
        backend = self.backends[op["backend"]]
        path = f"{backend.dcp}/{op['op']}-{op['rep']}"
        self.settle()
        dist.barrier()
        start = time.time()
        if op["op"] == "dcp_save":
            dcp.save(self.dcp_state, storage_writer=backend.dcp_writer(path))
            returned = end = time.time()
        else:
            future = dcp.async_save(self.dcp_state, storage_writer=backend.dcp_writer(path),
                                    async_stager=self.dcp_stager)
            returned = time.time()
            future.result()
            end = time.time()
        return {"start": start, "returned": returned, "blocking": returned - start, "end": end}

    # -- loads -----------------------------------------------------------------------------

    def cold(self, backend: str) -> None:
        """file://: rank 0 drops both systems' checkpoint files from the page cache (untimed).

        Every load then reads the disk, as a restore on a replaced machine does, whatever wrote
        the files: our shard files are written past the page cache (O_DIRECT) and DCP's through
        it, so without this DCP's loads would read memory and ours the disk. All files are
        fsynced, so their pages are clean and the advice drops them. The caller's barrier
        follows before any timed region.
        """
        b = self.backends[backend]
        if b.name != "file" or self.rank != 0:
            return
        for root in (self.storages[backend].root, b.dcp):
            for folder, _, files in os.walk(root):
                for name in files:
                    fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)

    def ours_load(self, op: dict, step: int, check: bool) -> dict:
        # Into zeroed tensors of the layout, allocated (and touched) before the clock starts,
        # as DCP's targets are: a restoring rank fills the state it holds.
        wanted = [w.with_tensor(torch.zeros(w.lengths, dtype=w.dtype)) for w in self.state.layout_slices(op["layout"])]
        catalog = Catalog(self.storages[op["backend"]])
        self.cold(op["backend"])
        dist.barrier()
        start = time.time()
        loaded = read_slices(catalog, step, wanted) if wanted else []
        end = time.time()
        result = {"start": start, "end": end, "active": bool(wanted)}
        if wanted:  # what the plan fetched, for the read amplification of a layout (untimed)
            result["nbytes"] = plan_reads(catalog.read_manifest(step).tensors, wanted).bytes_to_read
        if check:
            result["checked"] = self.state.check_loaded({p.name: p.tensor for p in loaded}, op["layout"])
        return result

    def dcp_load(self, op: dict, check: bool) -> dict:
        backend = self.backends[op["backend"]]
        targets = self.state.dcp_targets(op["layout"])
        group = self.state.pair_mesh.get_group() if op["layout"] == "dp2" and targets else None
        path = f"{backend.dcp}/dcp_save-{op['rep']}"
        self.cold(op["backend"])
        dist.barrier()
        start = time.time()
        if targets:
            dcp.load(targets, storage_reader=backend.dcp_reader(path), process_group=group)
        end = time.time()
        result = {"start": start, "end": end, "active": bool(targets)}
        if check:
            result["checked"] = self.state.check_loaded(targets, op["layout"])
        return result

    def raw_read(self, op: dict, step: int) -> dict:
        """The read floor: each rank reads its own whole shard file in one request, nothing else."""
        storage = self.storages[op["backend"]]
        path = storage.path(step_dir(step), self.shard_file[op["backend"]])
        self.cold(op["backend"])
        dist.barrier()
        start = time.time()
        data = storage.fs.cat_file(path)
        end = time.time()
        return {"start": start, "end": end, "active": True, "nbytes": len(data)}

    # -- clean-up (outside the timed regions) --------------------------------------------------

    def clean(self, backend: str, steps: list[int]) -> None:
        """Rank 0 deletes the repeat's checkpoints, so disk use stays at about one repeat's worth."""
        if self.rank == 0:
            storage, b = self.storages[backend], self.backends[backend]
            for step in steps:
                storage.remove_tree(storage.path(step_dir(step)))
            dcp_store = Storage(b.dcp, b.options) if b.name != "file" else Storage(f"file://{b.dcp}")
            dcp_store.remove_tree(dcp_store.root)
        dist.barrier()
