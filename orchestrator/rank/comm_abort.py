"""Abort a rank's process group so that every peer blocked in a collective is released at once.

Why this exists: when a rank dies, only its ring neighbours see a socket error. The other
survivors stay blocked in their collective until the process-group timeout (minutes) unless
the sockets of the ranks that did notice are closed. `destroy_process_group()` closes gloo's
sockets only when it drops the last reference to the group, and a DDP-wrapped model holds
one: measured on torch 2.13, gloo, 4 ranks, one SIGKILLed, a non-neighbour stayed blocked
until the others exited (`_abort_process_group()` did not release it either). Shutting the
pair sockets down (`shutdown(SHUT_RDWR)` on the connected ones; never the listener, which
gloo treats as fatal) makes every survivor's collective fail within milliseconds, whoever
holds the group, and the same processes then form a new group under a new store prefix in
~10-30 ms (python -m bench.release measures every collective the engine uses). On NCCL the
communicator abort does the equivalent.

NCCL's own watchdog must not undo this: on a collective error or timeout its default
(`TORCH_NCCL_ASYNC_ERROR_HANDLING=3`) kills the whole process, so a survivor whose peer died
(a network error seen before the controller's abort key) would die too instead of joining the
next generation. `capture()` therefore sets mode 2 where the environment does not choose one:
the watchdog aborts the communicators only, and the error reaches the training thread as an
exception at its next collective, handled as gloo's socket errors are.

Protocol (rank side, in `RankActor`):
  1. `with CommSockets.capture() as sockets: dist.init_process_group(...)` records the
     socket descriptors the group opened, the group's own store client opened inside the block
     among them, so a wait in the store ends with the abort too (and sets NCCL's error handling, read when each
     NCCL group is constructed). Every process group created later (a DeviceMesh's pp, tp and
     dp sub-groups) has sockets of its own: build them inside `with sockets.adding():`.
     Missing one is not harmless: a survivor blocked on a sub-group whose peer is alive but
     already out (a pipeline stage waiting on the dp neighbour of the dead rank) is released by
     nobody (python -m bench.release, collective `mesh`).
  2. `sockets.abort()` from the training thread after a collective error, or from the
     abort-watcher thread when the controller sets the abort key. Idempotent; thread-safe
     (shutdown on a socket is safe while another thread is blocked on it); a second caller
     returns only once the first's abort is done.
  3. `destroy_process_group()` afterwards, as usual.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading


def _socket_fds() -> dict[int, str]:
    """Open socket descriptors -> their identity (`socket:[inode]`), which tells a descriptor number
    reused by a later socket from the one recorded."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:"):
                fds[int(name)] = link
    return fds


NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # abort the communicators, keep the process


def set_nccl_error_handling(env=os.environ) -> None:
    """Abort-only NCCL error handling (module docstring), unless `env` already chooses a mode."""
    env.setdefault(*NCCL_ERROR_HANDLING)


ABORT_WAIT_S = 30.0  # a second caller's wait for the first abort (one stuck in ncclCommAbort is not waited out)

class CommSockets:
    def __init__(self) -> None:
        self.fds: dict[int, str] = {}  # descriptor -> socket identity when recorded
        self._since: dict[int, str] | None = None  # the sockets before an `adding` block that is running
        self._aborted = False
        self._lock = threading.Lock()

    @classmethod
    @contextlib.contextmanager
    def capture(cls):
        sockets = cls()
        set_nccl_error_handling()
        with sockets.adding():
            yield sockets

    @contextlib.contextmanager
    def adding(self):
        """Also record the sockets opened inside this block (process groups created after init).

        Any thread's new socket counts, so keep the block to group creation alone; `abort` leaves
        out Unix sockets (Ray's own: its raylet, its object store), which no process group uses."""
        before = self._since = _socket_fds()
        try:
            yield self
        finally:
            self._since = None
        # A new mapping, not an update: `abort` may be iterating the old one on the watcher's thread.
        self.fds = {**self.fds, **_opened_since(before)}
        if self._aborted:  # aborted while the block ran (a rank left mid-join): what it opened since goes too
            for fd, link in _opened_since(before).items():
                _shut(fd, link)

    def abort(self) -> int:
        """Shut down the group's connected sockets (gloo) or abort the communicator (nccl).

        Returns the number of sockets shut down. Whole under the lock: a second caller (the training
        thread's teardown beside the abort watcher's call) returns only once the first is done, so
        it never destroys the groups while they are being aborted."""
        if not self._lock.acquire(timeout=ABORT_WAIT_S):  # a first abort stuck in NCCL: go on, not hang too
            return 0
        try:
            if self._aborted:
                return 0
            self._aborted = True
            _abort_nccl()
            # Inside an `adding` block (a join's init_process_group waiting for a peer that never comes) the
            # sockets it opened so far are not recorded yet: they are shut too, so the wait ends at once.
            since = self._since
            opening = _opened_since(since) if since is not None else {}
            return sum(_shut(fd, link) for fd, link in {**self.fds, **opening}.items())
        finally:
            self._lock.release()


def _opened_since(before: dict[int, str]) -> dict[int, str]:
    return {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link}


def _shut(fd: int, link: str) -> bool:
    """Shut down the connected TCP socket recorded as descriptor `fd` (its identity `link`, socket:[inode]),
    if that socket is still open there; whether it did."""
    try:
        copy = os.dup(fd)  # duplicated first, then checked: the number cannot move meanwhile
    except OSError:
        return False  # already closed by the group itself
    try:
        sock = socket.socket(fileno=copy)
    except OSError:  # the number is no socket's now (a file, a pipe): its copy closed, never leaked
        os.close(copy)
        return False
    with sock, contextlib.suppress(OSError):
        if os.readlink(f"/proc/self/fd/{sock.fileno()}") != link:
            return False  # closed by the group itself, the number since reused by another socket
        if sock.family != socket.AF_UNIX and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RDWR)
            return True
    return False


def _abort_nccl() -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        with contextlib.suppress(Exception):
            abort()
