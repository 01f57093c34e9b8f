"""The checkpoint writer process's side (ckpt.process_writer): the child a rank starts as
`python -m ckpt.writer_child SOCKET_FD PARENT_PID`, and the staging buffer's layout both sides share.

Protocol: the child dies with its parent (PR_SET_PDEATHSIG), lowers its priority as the writer
thread does, reads its config (store URL and options, rank, block size, shard tag, chaos storage
set-up) from the socket, then serves jobs until the parent closes the socket or sends None. A job
names the step and each piece's geometry and offset in the shared buffer (whose descriptor follows
a job that brings a new one); the child answers "writing", then "progress" as the store takes bytes,
then "ok" with the receipt or "error" with the exception's words: never lost with the child.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import torch

from ckpt.blocks import ALIGN
from ckpt.shards import write_slices
from ckpt.shared_buffer import SharedBuffer
from ckpt.storage import Storage
from ckpt.writer import yield_cpu_to_training
from trainer.state_slices import TensorSlice

_PR_SET_PDEATHSIG = 1


def buffer_layout(pieces: Sequence[TensorSlice]) -> tuple[list[int], int]:
    """Byte offset of each piece in the flat staging buffer (ALIGN-aligned, so typed views are valid) and the total."""
    offsets, total = [], 0
    for piece in pieces:
        total += -total % ALIGN
        offsets.append(total)
        total += piece.nbytes
    return offsets, total


def piece_view(flat: torch.Tensor, offset: int, piece: TensorSlice) -> torch.Tensor:
    return flat[offset:offset + piece.nbytes].view(piece.dtype).view(piece.lengths)


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent goes (Linux); exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _serve(conn: Connection, parent_pid: int) -> None:
    """The child: write each job's slices from the shared buffer; answer with the receipt or the error."""
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)
    yield_cpu_to_training()  # the same priority the writer thread runs at
    config = conn.recv()
    send_lock = threading.Lock()  # storage-fault notices may come from a client's own threads

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    storage = Storage(config["url"], config["options"])
    if config["storage_setup"] is not None:
        config["storage_setup"](storage, lambda event: send(("notice", event, None)))
    buffer = None
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent closed the socket: stop
            return
        if job is None:
            return
        step = job["step"]
        if job["buffer_bytes"] is not None:  # a new buffer: its descriptor follows the job
            if buffer is not None:
                buffer.close()
            buffer = SharedBuffer(job["buffer_bytes"], fd=recv_handle(conn))
        try:
            send(("writing", None, step))
            staged = [piece.with_tensor(piece_view(buffer.tensor, offset, piece))
                      for piece, offset in zip(job["pieces"], job["offsets"], strict=True)]
            receipt = write_slices(storage, step, config["rank"], staged, job["blocking_s"], held=job["held"],
                                   block_bytes=config["block_bytes"], tag=config["tag"],
                                   on_progress=functools.partial(_progress, send, step))
            send(("ok", receipt.model_dump_json(), step))
        except BaseException as err:  # reported to the parent, never lost with the child
            send(("error", f"{type(err).__name__}: {err}", step))


def _progress(send: Callable[[tuple], None], step: int, nbytes: int) -> None:
    send(("progress", nbytes, step))


def main(argv: list[str]) -> None:
    """The writer process's entry point: `python -m ckpt.writer_child SOCKET_FD PARENT_PID`."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    _serve(Connection(fd), parent_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
