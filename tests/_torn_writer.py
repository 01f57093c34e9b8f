"""A checkpoint writer to be killed: the subprocess side of tests/s3/test_torn_writes.py.

Run as `python -m tests._torn_writer`, it is a fork server: it imports torch and the
checkpoint code once, then reads one JSON job per line on stdin and forks a writer for each
(an import of torch takes seconds on a busy machine; a fork takes milliseconds). For each
job it prints `pid <pid>` when the writer runs and `exit <pid> <wait status>` when the
writer has died and been reaped. The writer never exits by itself: after its last event
(or an error) it sleeps until the test kills it, so the pid the test kills is always this
writer's (it cannot have been reaped and reused).

The writer saves like a job does: step 10, then step 20, each by `WORLD` ranks through the
real `ShardWriter` (background threads, `write_slices`), their receipts fed to the
controller's `ckpt.commit.Committer`, which merges them and commits the manifest
with `Catalog.commit`. It reports what it is doing as lines on the job's FIFO (`events`);
`hold` names an event after which it stops (sleeps) so the test can kill it exactly there.

Events: `save_begin` (step 20 starts: staging), `shard_open F`, `wrote F K` (after the K-th
chunk of shard F was handed to the file), `part F N` (S3: N parts of F uploaded),
`shard_close F` (F is durable), `shards_done` (all receipts in, before the commit),
`manifest_begin S` / `manifest_end S` (around the manifest create of step S), `committed S`,
`done`, `error TEXT`. Shard and manifest events of step 10 are not reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import time
import traceback

import torch

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.manifest import MANIFEST_NAME
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from trainer.state_slices import TensorSlice

WORLD = 4
STEPS = (10, 20)
LAYOUT = {"dp": 1, "tp": WORLD, "pp": 1, "zero": 0}
BIG_SHARD = "shard-r00000.bin"  # rank 0 holds model/big: the shard that goes multipart on S3


def _sizes(step: int) -> dict[str, int]:
    """Rows of each logical tensor: step 20 is the big save, step 10 a small one."""
    big = step == 20
    return {"big": 4096 if big else 16, "w": 256 * WORLD if big else 4 * WORLD,
            "band": 2048 if big else 8}


def logical_state(step: int) -> dict[str, torch.Tensor]:
    """The whole state the job means to save at `step` (deterministic in `step`)."""
    g = torch.Generator().manual_seed(step)
    rows = _sizes(step)
    return {
        "model/big": torch.randn(rows["big"], 1024, generator=g),  # 16 MiB at step 20, rank 0 only
        "model/w": torch.randn(rows["w"], 1024, generator=g),  # tp row shards: 1 MiB per rank
        "model/b": torch.randn(1024, generator=g).to(torch.bfloat16),  # replicated, written by one rank
        "optim/band/exp_avg_sq": torch.randn(rows["band"], 640, generator=g),  # replicated, 5 MiB: row bands
        "ids": torch.arange(step, dtype=torch.int64),
    }


def rank_slices(state: dict[str, torch.Tensor], rank: int) -> list[TensorSlice]:
    """What rank `rank` holds: model/big on rank 0, a row shard of model/w, the replicated rest."""
    out = []
    for name, t in state.items():
        shape = tuple(t.shape)
        if name == "model/big":
            if rank == 0:
                out.append(TensorSlice(name, t.dtype, shape, (0,) * len(shape), shape, tensor=t))
        elif name == "model/w":
            rows = shape[0] // WORLD
            out.append(TensorSlice(name, t.dtype, shape, (rank * rows, 0), (rows, shape[1]),
                                   tensor=t[rank * rows:(rank + 1) * rows]))
        else:
            out.append(TensorSlice(name, t.dtype, shape, (0,) * len(shape), shape, replica=rank,
                                   replicas=WORLD, tensor=t))
    return out


class _Held(Exception):
    pass


class Events:
    def __init__(self, fd: int, hold: str | None):
        self.fd = fd
        self.hold = hold
        self.active = False  # shard and manifest events are reported from save_begin (step 20) on

    def __call__(self, line: str, always: bool = False) -> None:
        self.active = self.active or line == "save_begin"
        if not (self.active or always):
            return
        os.write(self.fd, (line + "\n").encode())  # under PIPE_BUF: atomic between threads
        if line == self.hold:
            while True:  # stopped here until the test kills us
                time.sleep(60)


class _Probe:
    """The shard file handed to write_slices, reporting chunk writes and S3 part uploads."""

    def __init__(self, f, name: str, emit: Events):
        self.f, self.name, self.emit = f, name, emit
        self.chunks = 0
        self.parts = 0

    def write(self, data) -> int:
        n = self.f.write(data)
        parts = len(getattr(self.f, "parts", None) or ())
        while self.parts < parts:  # one event per part, even when a write uploads several
            self.parts += 1
            self.emit(f"part {self.name} {self.parts}")
        if len(data):
            self.chunks += 1
            self.emit(f"wrote {self.name} {self.chunks}")
        return n


class InstrumentedStorage(Storage):
    """A Storage that reports shard and manifest writes (it changes nothing about them)."""

    emit: Events | None = None

    @contextlib.contextmanager
    def atomic_writer(self, path: str):
        name = path.rsplit("/", 1)[-1]
        self.emit(f"shard_open {name}")
        with super().atomic_writer(path) as f:
            probe = _Probe(f, name, self.emit)
            yield probe
            # s3fs uploads the last part and completes the upload only when the block exits.
        self.emit(f"shard_close {name}")

    def create_exclusive(self, path: str, data: bytes) -> None:
        step = path.rsplit("/", 2)[-2]
        manifest = path.endswith("/" + MANIFEST_NAME)
        if manifest:
            self.emit(f"manifest_begin {step}")
        super().create_exclusive(path, data)
        if manifest:
            self.emit(f"manifest_end {step}")


def run_job(job: dict, fd: int) -> None:
    emit = Events(fd, job.get("hold"))
    torch.set_num_threads(1)
    storage = InstrumentedStorage(job["url"], job.get("options") or {}, multipart_chunk=job["multipart_chunk"])
    storage.emit = emit
    catalog = Catalog(storage)
    committer = Committer(catalog, job="torn", spec_hash="h", keep=3)
    committer.reset(None)
    receipts: queue.Queue = queue.Queue()
    writers = [ShardWriter(storage, rank, on_receipt=lambda r, extra: receipts.put((r, extra)),
                           on_error=lambda step, err: receipts.put((None, err))) for rank in range(WORLD)]
    for step in STEPS:
        state = logical_state(step)
        if step == 20:
            emit("save_begin")
        for rank, writer in enumerate(writers):
            writer.save(step, rank_slices(state, rank), {"engine": {"next_step": step}})
        commit = None
        for n in range(WORLD):
            receipt, extra = receipts.get()
            if receipt is None:
                raise extra
            if n == WORLD - 1 and step == 20:
                emit("shards_done")
            commit = committer.on_receipt(receipt, extra, WORLD, 0, LAYOUT, dict)
        if commit is None:
            raise RuntimeError(f"step {step} did not commit: {committer.rejected}")
        emit(f"committed {step}", always=True)
    emit("done")


def _child(job: dict) -> None:
    fd = os.open(job["fifo"], os.O_WRONLY)
    try:
        run_job(job, fd)
    except BaseException:
        text = traceback.format_exc().replace("\n", " | ")[-3000:]
        os.write(fd, f"error {text}\n".encode())
    while True:
        time.sleep(60)


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _child(job)
            finally:
                os._exit(1)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


if __name__ == "__main__":
    serve()
