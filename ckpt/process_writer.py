"""A rank's checkpoint writer whose shard writes run in a child process, for object stores.

Why: `ckpt.writer.ShardWriter` writes from a thread of the rank's own process, so it shares the
training thread's GIL. On file:// that costs training little (the direct-I/O writes, the copies
and the checksums release the GIL), but a Python object-store client (s3fs over aiohttp) holds
it for much of an upload: on s3:// a save cost the training loop 1.9-2.7 s with the writer
thread against 0.07-0.8 s with a writer process (python -m bench.ckpt, thread-vs-process section).
Chosen per job by `checkpoint.writer` (`auto`: this writer on object stores).

Protocol (the same as `ShardWriter`'s, so the rank loop drives either; one instance per rank,
driven by one thread, which must also be the one that calls `flush`):
  1. `save(step, slices, extra)` waits for a save still in flight (one snapshot staged at
     most, docs/design.md invariant 6; the wait is blocking time and is counted in `waited`),
     copies this rank's share (`ckpt.shards.slices_to_write`) into one shared-memory staging
     buffer (the only work training waits for), calls `fault_hook("during_stage", step)`,
     sends the geometry to the child and returns the blocking seconds.
  2. The child runs `ckpt.shards.write_slices` on views of that buffer (the very function the
     writer thread runs), tells the bytes the store took as it goes (`written_bytes`), and
     answers with the receipt. The parent's listener thread then calls
     `on_receipt(receipt, extra)`, or `on_error(step, error)` when the write failed.
  3. `wait()` waits for the save in flight; `flush()` waits, then stops the child.

The child is a fresh interpreter (`python -m ckpt.writer_child`, its side: not a fork: forking a process
running gloo threads is unsafe; not multiprocessing's spawn, which re-runs the parent's main
script), started when the writer is built, so its start-up overlaps training; a save never
waits for it, since jobs queue on the control socket. It dies with its parent
(PR_SET_PDEATHSIG, which follows the thread that started it: hence one thread for
construction and `flush`), so a killed rank leaves no writer finishing a shard of a
generation that is gone. If the child dies (OOM killer, crash), the save in flight goes to
`on_error` and the next save starts a new child. A write whose store takes no byte for `stall_s`
(a hung upload: a body that stalled mid-transfer, or a completion that never returns, which no
client timeout bounds) has its child killed the same way: the save fails and is counted
(checkpoint.max_failed_saves) while training goes on, well before the controller would take the
ranks blocked behind it for hung (orchestrator.controller.save_watch: 120 s of no bytes at least)
and roll the whole job back.

The staging buffer is one flat shared tensor, allocated at the first save (and again only when
a save needs more room) and sent to the child once; later saves copy into it, so a warm save
neither allocates nor faults in pages. When the state is on a GPU, the buffer is page-locked
for CUDA (cudaHostRegister) at the first save, and the copies run asynchronously with one
synchronisation per device, as with the thread writer's pinned staging. Reusing the buffer is
safe for the reason `StagingPool` is: a save refills it only after the previous write ended.

Chaos: `storage_setup(storage, notify)` runs in the child on its Storage (it must pickle: a
module-level function or a `functools.partial` of one, over picklable data such as
chaos.config.ArmedFault); storage-fault notices it raises come back through the listener to
`notify`. The point "during_shard_write" fires in the parent's listener thread when the child
begins a write, so a kill there ends the rank (and with it the child) mid-write, as with the
writer thread; a fault hook that raises there makes the save fail (`on_error`; the receipt, if
the write still lands, is dropped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

import torch

from ckpt.blocks import BLOCK_BYTES
from ckpt.manifest import ShardReceipt
from ckpt.shared_buffer import SharedBuffer
from ckpt.staging import copy_into
from ckpt.storage import Storage
from ckpt.writer import OneSaveInFlight
from ckpt.writer_child import buffer_layout, piece_view
from trainer.state_slices import TensorSlice

log = logging.getLogger(__name__)

# A write whose store took nothing this long is given up (module docstring): under the controller's
# 120 s stall floor (orchestrator.controller.save_watch.SAVE_STALL_FLOOR_S), over botocore's own
# attempts of a call that fails (about 75-90 s), and over the parts one progress piece can take to
# upload (up to two of 64 MiB: s3fs uploads as its buffer fills) at about 1.3 MB/s or more.
STALL_S = 100.0
# A child started for a save (after one died) imports torch first: not the store's stall, so judged
START_S = 60.0  # against this until it says it writes
STALL_POLL_S = 5.0
DEATH_WAIT_S = 10.0  # a killed child whose socket is still open this long after is taken for dead


class WriterProcessDied(RuntimeError):
    """The writer's child process exited while a shard was being written (that save never commits)."""


class ShardWriteFailed(RuntimeError):
    """The child could not write a shard; the message is the child's exception."""


class _Child:
    """One writer process, the rank's end of its control socket, and the buffer it has mapped."""

    def __init__(self, config: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The child imports this package the way the rank did.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt.writer_child", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, close_fds=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(config)
        self.buffer_sent: SharedBuffer | None = None
        self.stopping = False
        self.killed_at: float | None = None  # when the parent killed it (monotonic)

    def kill(self) -> None:
        self.killed_at = self.killed_at or time.monotonic()
        with contextlib.suppress(OSError):
            self.proc.kill()  # by its PID, never by name

    def send_job(self, job: dict, buffer: SharedBuffer) -> None:
        fresh = self.buffer_sent is not buffer
        self.conn.send(dict(job, buffer_bytes=buffer.nbytes if fresh else None))
        if fresh:
            send_handle(self.conn, buffer.fd, self.proc.pid)
            self.buffer_sent = buffer

    def stop(self, timeout_s: float) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            self.conn.send(None)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # by its PID, never by name
            # A child stuck in the kernel (a write to a hung NFS or FUSE mount) exits when that returns: the
            # rank does not wait for it (its listener ends once the socket is closed).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)


class ProcessShardWriter(OneSaveInFlight):
    def __init__(
        self, url: str, options: dict, rank: int,
        on_receipt: Callable[[ShardReceipt, dict], None],
        on_error: Callable[[int, BaseException], None],
        fault_hook: Callable[[str, int], None] | None = None,
        block_bytes: int = BLOCK_BYTES,
        tag: str = "",
        storage_setup: Callable[[Storage, Callable[[dict], None]], None] | None = None,
        notify: Callable[[dict], None] | None = None,
        stall_s: float = STALL_S,
    ):
        self.rank, self.stall_s = rank, stall_s
        self._moved_at = time.monotonic()  # when the write in flight last moved (handed over, or bytes taken)
        self._writing: int | None = None  # the step the child said it writes (its "writing" message)
        self._stalled_s: float | None = None  # set when the write in flight was given up for stalling
        self.on_receipt = on_receipt
        self.on_error = on_error
        self.fault_hook = fault_hook  # chaos points "during_stage" and "during_shard_write"
        self.notify = notify
        super().__init__()
        self._config = {"url": url, "options": dict(options), "rank": rank, "block_bytes": block_bytes, "tag": tag,
                        "storage_setup": storage_setup}
        self._buffer: SharedBuffer | None = None
        # (step, extra, the child writing it) of the save in flight: a child given up for stalling that
        # answers, or dies, after the next save started another must not end that save
        self._in_flight: tuple[int, dict, _Child] | None = None
        self._hook_failed: int | None = None
        self._child: _Child | None = None
        self._listener: threading.Thread | None = None
        # Orders a save's hand-over against the listener's handling of a child's death: either the
        # job reaches the child first (and the death handler fails it), or the save sees no child
        # and starts a new one.
        self._lock = threading.Lock()
        self._start_child()

    @property
    def pid(self) -> int | None:
        """The writer process's PID (None between a child's death and the next save)."""
        return self._child.proc.pid if self._child is not None else None

    def _start_child(self) -> None:
        child = _Child(self._config)
        self._child = child
        self._listener = threading.Thread(target=self._listen, args=(child,), name=f"ckpt-writer-listen-r{self.rank}",
                                          daemon=True)
        self._listener.start()

    def save(self, step: int, slices: Sequence[TensorSlice], extra: dict) -> float:
        """Stage this rank's share of `slices` in shared memory and start the child's write; the blocking seconds."""
        started = time.perf_counter()
        held, mine = self._take_turn(slices)
        for piece in mine:
            if piece.tensor is None:
                raise ValueError(f"{piece.name}{list(piece.offsets)}: a slice to save has no data")
        offsets, total = buffer_layout(mine)
        if self._buffer is None or self._buffer.nbytes < total:
            old, self._buffer = self._buffer, None  # never a closed buffer (its fd number reused) if this fails
            if old is not None:
                old.close()
            self._buffer = SharedBuffer(total)
        devices = {piece.tensor.device for piece in mine if piece.tensor.device.type == "cuda"}
        pinned = bool(devices) and self._buffer.pin()
        for piece, offset in zip(mine, offsets, strict=True):
            copy_into(piece_view(self._buffer.tensor, offset, piece), piece.tensor.detach(), non_blocking=pinned)
        for device in devices:  # pinned copies may still be in flight
            torch.cuda.synchronize(device)
        if self.fault_hook is not None:
            self.fault_hook("during_stage", step)
        blocking_s = time.perf_counter() - started
        job = {"step": step, "pieces": [p.with_tensor(None) for p in mine], "offsets": offsets, "held": held,
               "blocking_s": blocking_s}
        with self._lock:
            if self._child is None:
                self._start_child()
            self._idle.clear()
            self._writing = None
            self._moved_at = time.monotonic()  # before the save shows as in flight: the watchdog reads in that order
            self._in_flight = (step, extra, self._child)
            # A child that died is found by its listener (end of file), which fails this save.
            with contextlib.suppress(OSError):
                self._child.send_job(job, self._buffer)
        return blocking_s

    def _listen(self, child: _Child) -> None:
        """The listener thread of one child: hand on its messages until it stops or dies."""
        while True:
            try:
                if not child.conn.poll(min(self.stall_s, STALL_POLL_S)):
                    if child.killed_at is not None and time.monotonic() - child.killed_at > DEATH_WAIT_S:
                        raise EOFError  # killed, yet its socket stays open: stuck in the kernel, dead to us
                    self._give_up_if_stalled(child)
                    continue
                message = child.conn.recv()
            except (EOFError, OSError):  # the child exited, or closed its end
                if not child.stopping:
                    self._child_died(child)
                return
            try:
                self._handle(child, *message)
            except Exception:  # noqa: BLE001 (a bug: logged; the listener must outlive it to see the child die)
                log.exception("rank %d: the checkpoint writer's message %s could not be handled", self.rank, message[0])

    def _give_up_if_stalled(self, child: _Child) -> None:
        """Kill the child of a write whose store took nothing for `stall_s`; its death fails the save."""
        in_flight = self._in_flight
        if in_flight is None or in_flight[2] is not child or child.stopping:  # read first: `save` sets
            return  # `_moved_at` before it
        stalled_s = time.monotonic() - self._moved_at
        if stalled_s < (self.stall_s if self._writing == in_flight[0] else max(self.stall_s, START_S)):
            return
        self._stalled_s = stalled_s
        with self._lock:  # the next save starts a new child, even if a receipt slips in before the kill lands
            if self._child is child:
                self._child = None
        child.kill()

    def _handle(self, child: _Child, kind: str, payload, step: int | None) -> None:
        in_flight = self._in_flight
        if kind != "notice" and (in_flight is None or in_flight[2] is not child or in_flight[0] != step):
            return  # from a child given up for stalling, after the next save started another
        if kind in ("progress", "writing"):
            self._moved_at = time.monotonic()
        if kind == "writing":
            self._writing = step
        if kind == "notice":  # a chaos fault's: one that cannot be sent must not end the listener (no receipt after)
            if self.notify is not None:
                with contextlib.suppress(Exception):
                    self.notify(payload)
            return
        if kind == "progress":
            self._count(payload)
            return
        if kind == "writing":
            if self.fault_hook is not None:
                try:
                    self.fault_hook("during_shard_write", step)
                except BaseException as err:  # the save fails, as when the hook raises in the writer thread
                    self._hook_failed = step
                    self._report(step, err)
            return
        extra = in_flight[1]
        try:
            if self._hook_failed == step:
                pass  # already reported as failed; without a receipt the save never commits
            elif kind == "ok":
                self.on_receipt(ShardReceipt.model_validate_json(payload), extra)
            else:
                self._report(step, ShardWriteFailed(payload))
        except BaseException as err:  # reported, never raised into the listener's loop
            self._report(step, err)
        finally:
            self._hook_failed = None
            self._in_flight = None
            self._idle.set()

    def abandon(self) -> None:
        """OneSaveInFlight.abandon: the child is killed (the save cannot commit; its staging buffer
        and its process must not outlive the generation); its listener then ends the save, unreported."""
        super().abandon()
        with self._lock:
            child = self._child
        if child is not None:
            child.kill()

    def _child_died(self, child: _Child) -> None:
        with self._lock:
            if self._child is child:
                self._child = None  # the next save starts a new one
            lost = self._in_flight if self._in_flight is not None and self._in_flight[2] is child else None
            if lost is not None:  # else the save in flight is another child's: it goes on
                self._in_flight, self._hook_failed = None, None
            stalled_s, self._stalled_s = self._stalled_s, None
        child.stop(5.0)
        child.conn.close()
        if lost is not None and self.abandoned:
            self._idle.set()
        elif lost is not None:
            step = lost[0]
            why = (f"was killed: the store took no byte of step {step} for {stalled_s:.0f} s (a hung upload)"
                   if stalled_s is not None else f"exited (code {child.proc.returncode}) while writing step {step}")
            try:
                self._report(step, WriterProcessDied(f"the checkpoint writer process of rank {self.rank} {why}"))
            finally:
                self._idle.set()

    def flush(self, timeout_s: float = 30.0) -> None:
        """`wait`, then stop the child and free the staging buffer (a later save starts a new child)."""
        self._wait_idle()
        with self._lock:
            child, listener = self._child, self._listener
            self._child = self._listener = None
        if child is not None:
            child.stop(timeout_s)  # the child exits, its end closes, the listener returns
        if listener is not None:
            listener.join(timeout_s)
        if child is not None:
            child.conn.close()
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
