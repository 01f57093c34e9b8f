"""The writer process: the same shards as the writer thread, errors and deaths reported, no orphans.

Each test starts real child processes ("spawn"), so each costs a second or two.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pydantic
import pytest
import torch

from chaos.storage_faults import install_on
from ckpt.catalog import Catalog
from ckpt.config import CheckpointConfig
from ckpt.manifest import step_dir
from ckpt.process_writer import ProcessShardWriter, ShardWriteFailed, WriterProcessDied
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from trainer.state_slices import whole


def _state(seed: int = 5, rows: int = 256) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/wide": torch.randn(rows, 1024, generator=g),  # >= 1 MiB: stored as column tiles
        "model/half": torch.randn(64, 1024, generator=g).to(torch.bfloat16),
        "model/b": torch.randn(4, generator=g),
        "optim/step": torch.tensor(3.0),
    }


class Collect:
    def __init__(self):
        self.receipts, self.errors, self.notices, self.threads = [], [], [], []

    def on_receipt(self, receipt, extra):
        self.threads.append(threading.current_thread().name)
        self.receipts.append((receipt, extra))

    def on_error(self, step, err):
        self.errors.append((step, err))

    def notify(self, event):
        self.notices.append(event)


def _commit(storage: Storage, receipt, extra) -> dict[str, torch.Tensor]:
    Catalog(storage).commit(job="j", step=receipt.step, generation=0, layout={}, spec_hash="h",
                            receipts=[receipt], state=extra)
    tensors, _ = load_checkpoint(Catalog(storage), receipt.step)
    return tensors


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_shards_are_byte_identical_to_the_writer_threads_and_the_snapshot_is_taken_at_save(tmp_path):
    state = _state()
    expected = {name: t.clone() for name, t in state.items()}
    slices = [whole(name, t) for name, t in state.items()]
    url = f"file://{tmp_path}/proc/job"
    out = Collect()
    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error)
    pid = writer.pid
    writer.save(1, slices, {"engine": {"next_step": 1}})
    state["model/wide"].add_(1.0)  # training goes on at once; the staged snapshot must not change
    writer.save(2, slices, {})  # waits for step 1's write: one snapshot in flight at most
    writer.flush()
    assert not out.errors and [r.step for r, _ in out.receipts] == [1, 2]
    assert set(out.threads) == {"ckpt-writer-listen-r0"} and _wait_gone(pid)
    loaded = _commit(Storage(url), *out.receipts[0])
    assert all(torch.equal(loaded[name], t) for name, t in expected.items())

    thread_storage, thread_out = Storage(f"file://{tmp_path}/thread/job"), Collect()
    thread_writer = ShardWriter(thread_storage, 0, thread_out.on_receipt, thread_out.on_error, async_save=True)
    thread_writer.save(1, [whole(name, t) for name, t in expected.items()], {})
    thread_writer.flush()
    proc_receipt, thread_receipt = out.receipts[0][0], thread_out.receipts[0][0]
    assert len(proc_receipt.tensors["model/wide"].chunks) > 1
    assert proc_receipt.tensors == thread_receipt.tensors
    read = Storage(url).read(Storage(url).path(step_dir(1), proc_receipt.file))
    assert read == thread_storage.read(thread_storage.path(step_dir(1), thread_receipt.file))


def test_a_larger_state_regrows_the_shared_buffer_and_a_new_child_gets_it(tmp_path):
    url = f"file://{tmp_path}/job"
    out = Collect()
    writer = ProcessShardWriter(url, {}, 2, out.on_receipt, out.on_error)
    small, large = _state(1, rows=64), _state(2, rows=512)
    writer.save(1, [whole(n, t) for n, t in small.items()], {})
    writer.wait()
    first = writer._buffer.nbytes
    writer.save(2, [whole(n, t) for n, t in large.items()], {})
    writer.wait()
    assert writer._buffer.nbytes > first
    writer.flush()  # stops the child; the next save starts a fresh one, which must get the buffer
    writer.save(3, [whole(n, t) for n, t in small.items()], {})
    writer.flush()
    assert not out.errors and [r.step for r, _ in out.receipts] == [1, 2, 3]
    for (receipt, extra), state in zip(out.receipts, (small, large, small), strict=True):
        loaded = _commit(Storage(url), receipt, extra)
        assert all(torch.equal(loaded[n], t) for n, t in state.items())


def test_a_buffer_that_cannot_grow_fails_that_save_only_and_leaks_no_descriptor(tmp_path, monkeypatch):
    import errno
    import mmap

    from ckpt import shared_buffer

    url, out = f"file://{tmp_path}/job", Collect()
    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error)
    small, large = _state(1, rows=64), _state(2, rows=512)
    writer.save(1, [whole(n, t) for n, t in small.items()], {})
    writer.wait()
    limit, real_mmap = writer._buffer.nbytes, mmap.mmap

    def bounded_mmap(fd, length, *args, **kwargs):
        if length > limit:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_mmap(fd, length, *args, **kwargs)

    monkeypatch.setattr(shared_buffer.mmap, "mmap", bounded_mmap)
    def staging_fds() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum("undying-ckpt-staging" in link for link in links)

    assert staging_fds() >= 1
    with pytest.raises(OSError, match="Cannot allocate memory"):
        writer.save(2, [whole(n, t) for n, t in large.items()], {})
    assert staging_fds() == 0  # the old buffer's memfd closed, and the one that could not be mapped
    writer.save(3, [whole(n, t) for n, t in small.items()], {})  # a fresh buffer, never the closed one
    writer.flush()
    assert not out.errors and [r.step for r, _ in out.receipts] == [1, 3]
    loaded = _commit(Storage(url), *out.receipts[1])
    assert all(torch.equal(loaded[n], t) for n, t in small.items())


def test_a_failed_write_is_reported_with_the_childs_error_and_the_writer_goes_on(tmp_path):
    url = f"file://{tmp_path}/job"
    out = Collect()
    # A storage error on this rank's first shard write, injected in the child by the chaos setup.
    fault = {"kind": "storage_error", "rank": 0, "path": "*/shard-*", "nth": 1}
    setup = functools.partial(install_on, faults=[fault], seed=0, started=time.time())
    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error, storage_setup=setup, notify=out.notify)
    slices = [whole(n, t) for n, t in _state().items()]
    writer.save(1, slices, {})
    writer.save(2, slices, {})
    writer.flush()
    assert [(s, type(e)) for s, e in out.errors] == [(1, ShardWriteFailed)]
    assert "InjectedStorageError" in str(out.errors[0][1])
    assert [r.step for r, _ in out.receipts] == [2]
    assert [n["kind"] for n in out.notices] == ["storage_error"]


def test_a_fault_notice_that_cannot_be_sent_leaves_the_listener_reading_receipts(tmp_path):
    """The store refuses the notice (or it is malformed): the save's receipt after it still arrives,
    where the training thread would otherwise wait on a listener that is gone."""
    url = f"file://{tmp_path}/job"
    out = Collect()

    def refused(event):
        raise ConnectionError("the store refused the notice")

    fault = {"kind": "storage_error", "rank": 0, "path": "*/shard-*", "nth": 1}
    setup = functools.partial(install_on, faults=[fault], seed=0, started=time.time())
    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error, storage_setup=setup, notify=refused)
    slices = [whole(n, t) for n, t in _state().items()]
    writer.save(1, slices, {})
    writer.save(2, slices, {})
    writer.flush()
    assert [s for s, _ in out.errors] == [1] and [r.step for r, _ in out.receipts] == [2]


def test_a_killed_child_fails_the_save_in_flight_and_the_next_save_starts_a_new_one(tmp_path):
    url = f"file://{tmp_path}/job"
    out = Collect()
    started = threading.Event()

    def hook(point, step):  # runs in the listener when the child begins writing step 1
        if point == "during_shard_write" and step == 1:
            os.kill(writer.pid, signal.SIGKILL)
            started.set()

    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error, fault_hook=hook)
    first = writer.pid
    slices = [whole(n, t) for n, t in _state().items()]
    writer.save(1, slices, {})
    writer.wait()
    assert started.is_set() and [(s, type(e)) for s, e in out.errors] == [(1, WriterProcessDied)]
    assert writer.pid is None and _wait_gone(first)
    writer.save(2, slices, {})
    writer.flush()
    assert [r.step for r, _ in out.receipts] == [2] and len(out.errors) == 1


def test_a_write_whose_store_takes_nothing_is_given_up_as_a_failed_save_and_the_next_one_writes(tmp_path):
    # A hung upload (its body stalled, its completion never answered) has no client timeout: the
    # store "holds" the first shard write here for 120 s; the writer gives it up after its stall limit.
    url, out = f"file://{tmp_path}/job", Collect()
    stuck = {"kind": "storage_latency", "rank": 0, "delay_s": 120, "path": "*/step-000000001/shard-*"}
    setup = functools.partial(install_on, faults=[stuck], seed=0, started=time.time())
    writer = ProcessShardWriter(url, {}, 0, out.on_receipt, out.on_error, storage_setup=setup, stall_s=1.5)
    first, slices = writer.pid, [whole(n, t) for n, t in _state().items()]
    started = time.monotonic()
    writer.save(1, slices, {})
    writer.wait()
    assert time.monotonic() - started < 30 and _wait_gone(first)
    [(step, error)] = out.errors
    assert step == 1 and isinstance(error, WriterProcessDied) and "took no byte of step 1 for" in str(error)
    writer.save(2, slices, {})  # a new child; the fault held only the first write
    writer.flush()
    assert [r.step for r, _ in out.receipts] == [2] and len(out.errors) == 1


def test_a_write_whose_bytes_keep_moving_is_not_given_up(tmp_path):
    # The watchdog's clock is the last sign of movement (a piece the store took): a long write that
    # keeps moving is not a stalled one. Driven directly: the listener's poll would wait STALL_POLL_S.
    out = Collect()
    writer = ProcessShardWriter(f"file://{tmp_path}/job", {}, 0, out.on_receipt, out.on_error, stall_s=1.0)
    child = writer._child
    writer._idle.clear()
    writer._in_flight, writer._moved_at = (1, {}, child), time.monotonic() - 5.0
    writer._writing = 1  # the child said it writes step 1: from here its store's silence counts
    writer._handle(child, "progress", 1 << 20, 1)  # the store just took a piece
    writer._give_up_if_stalled(child)
    assert writer._child is child and child.proc.poll() is None
    writer._moved_at = time.monotonic() - 5.0  # and then nothing for longer than stall_s
    writer._give_up_if_stalled(child)
    assert writer._child is None and child.proc.wait(10) is not None
    writer.wait()
    [(step, error)] = out.errors
    assert step == 1 and "took no byte of step 1 for 5 s" in str(error)
    writer.flush()


def test_a_fault_hook_that_raises_at_during_shard_write_fails_the_save(tmp_path):
    out, points = Collect(), []

    def hook(point, step):
        points.append((point, step, threading.current_thread().name))
        if point == "during_shard_write" and step == 1:
            raise RuntimeError("injected")

    writer = ProcessShardWriter(f"file://{tmp_path}/job", {}, 1, out.on_receipt, out.on_error, fault_hook=hook)
    slices = [whole(n, t) for n, t in _state().items()]
    writer.save(1, slices, {})
    writer.save(2, slices, {})
    writer.flush()
    assert [(s, str(e)) for s, e in out.errors] == [(1, "injected")]
    assert [r.step for r, _ in out.receipts] == [2]
    main = threading.current_thread().name
    assert points == [("during_stage", 1, main), ("during_shard_write", 1, "ckpt-writer-listen-r1"),
                      ("during_stage", 2, main), ("during_shard_write", 2, "ckpt-writer-listen-r1")]


def test_the_child_dies_with_its_parent_even_mid_write(tmp_path):
    """A rank killed outright (SIGKILL: no cleanup runs) leaves no writer process behind, even one
    busy writing (an idle one would also see its socket close; a busy one is not reading it)."""
    script = textwrap.dedent(f"""
        import functools, os, sys, threading, time
        import torch
        sys.path.insert(0, {os.getcwd()!r})
        from chaos.storage_faults import install_on
        from ckpt.process_writer import ProcessShardWriter
        from trainer.state_slices import whole
        stuck = {{"kind": "storage_latency", "rank": 0, "delay_s": 120, "path": "*/shard-*"}}
        writing = threading.Event()
        writer = ProcessShardWriter(
            "file://{tmp_path}/job", {{}}, 0, print, print,
            fault_hook=lambda point, step: point == "during_shard_write" and writing.set(),
            storage_setup=functools.partial(install_on, faults=[stuck], seed=0, started=time.time()))
        writer.save(1, [whole("w", torch.ones(1000))], {{}})
        writing.wait()
        print(writer.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # well inside the 120 s the child's shard write is held for
        os.kill(child, 0)  # alive while its parent is
        parent.kill()
        parent.wait()
        assert _wait_gone(child), f"writer process {child} outlived its parent"
    finally:
        parent.kill()
        parent.wait()


def test_auto_picks_the_process_for_object_stores_and_bad_choices_are_named():
    def resolved(url, **extra):
        return CheckpointConfig(url=url, **extra).resolved_writer

    assert resolved("s3://b/p") == resolved("s3a://b/p") == "process"
    assert resolved("/tmp/x") == resolved("memory://x") == "thread"
    assert resolved("s3://b/p", **{"async": False}) == "thread"  # a synchronous save writes from the training thread
    assert resolved("/tmp/x", writer="process") == "process" and resolved("s3://b/p", writer="thread") == "thread"
    with pytest.raises(pydantic.ValidationError, match="writer='process'.*async is false.*set async: true"):
        CheckpointConfig(url="/tmp/x", writer="process", **{"async": False})
    with pytest.raises(pydantic.ValidationError, match="writer='process' cannot write to memory://"):
        CheckpointConfig(url="memory://x", writer="process")
    with pytest.raises(pydantic.ValidationError, match="writer"):
        CheckpointConfig(url="/tmp/x", writer="fork")


def test_a_child_given_up_for_stalling_neither_fails_nor_ends_the_save_the_next_child_writes(tmp_path):
    # Its answer for the stalled step slipped in before the kill landed, the next save started a
    # new child, and only then did the old child's death reach its listener: that death is the old
    # child's alone. Driven directly: the real listener's timing would leave the order to chance.
    out = Collect()
    writer = ProcessShardWriter(f"file://{tmp_path}/job", {}, 0, out.on_receipt, out.on_error, stall_s=1.0)
    slices = [whole(n, t) for n, t in _state().items()]
    old = writer._child
    writer._idle.clear()
    writer._in_flight, writer._moved_at, writer._writing = (1, {}, old), time.monotonic() - 5.0, 1
    writer._give_up_if_stalled(old)
    assert writer._child is None and old.proc.wait(10) is not None
    old.stopping = True  # its listener leaves the death to this test
    writer._handle(old, "error", "OSError: the store hung", 1)  # the answer that slipped in: step 1 fails
    writer.save(2, slices, {"step": 2})
    writer._handle(old, "progress", 1 << 20, 2)  # nothing of the old child's counts for step 2
    writer._child_died(old)
    writer.wait()
    assert [step for step, _ in out.errors] == [1]
    [(receipt, extra)] = out.receipts
    assert receipt.step == 2 and extra == {"step": 2}
    writer.flush()


def _within(seconds: float, work) -> None:
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work(), done.set()), daemon=True)
    thread.start()
    assert done.wait(seconds), "the writer hung"


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_writer_whose_error_report_fails_too_goes_on_saving(tmp_path, kind):
    # The rank's channel to the controller is gone: handing on the receipt fails, and so does
    # reporting that. The writer logs it and serves the next save; it must not die and leave every
    # later save waiting on it.
    reported = []

    def on_receipt(receipt, extra):
        raise ConnectionError("the rank's store connection is gone")

    def on_error(step, err):
        reported.append(step)
        raise ConnectionError("the rank's store connection is gone")

    url = f"file://{tmp_path}/job"
    writer = (ShardWriter(Storage(url, {}), 0, on_receipt, on_error) if kind == "thread" else
              ProcessShardWriter(url, {}, 0, on_receipt, on_error))
    slices = [whole(n, t) for n, t in _state().items()]
    for step in (1, 2):
        _within(60, lambda step=step: (writer.save(step, slices, {}), writer.wait()))
    _within(60, writer.flush)
    assert reported == [1, 2]


def test_stopping_a_child_stuck_in_the_kernel_does_not_hold_the_rank(tmp_path):
    class Unkillable:  # a process in uninterruptible I/O: SIGKILL lands only when the I/O returns
        pid, returncode = 0, None

        def wait(self, timeout=None):
            if timeout is None:
                threading.Event().wait()
            raise subprocess.TimeoutExpired("writer", timeout)

        def kill(self):
            pass

    writer = ProcessShardWriter(f"file://{tmp_path}/job", {}, 0, Collect().on_receipt, Collect().on_error)
    child = writer._child
    real, child.proc = child.proc, Unkillable()
    try:
        _within(10, lambda: writer.flush(timeout_s=0.2))
    finally:
        real.kill()
        real.wait(10)


def test_a_killed_child_whose_socket_stays_open_is_taken_for_dead(tmp_path, monkeypatch):
    # Stuck in the kernel (a hung NFS or FUSE write), a killed child keeps its end of the socket open:
    # no end of file ever comes. Past DEATH_WAIT_S it counts as dead: its save fails, the writer goes on.
    from ckpt import process_writer

    monkeypatch.setattr(process_writer, "DEATH_WAIT_S", 0.5)
    out = Collect()
    writer = ProcessShardWriter(f"file://{tmp_path}/job", {}, 0, out.on_receipt, out.on_error, stall_s=1.0)
    child = writer._child
    child.proc.kill = lambda: None  # the kill does not land (the process cannot die yet)
    writer._idle.clear()
    writer._in_flight, writer._moved_at, writer._writing = (1, {}, child), time.monotonic() - 5.0, 1
    _within(20, writer.wait)  # the listener's own poll gives the write up, then the child for dead
    [(step, error)] = out.errors
    assert step == 1 and isinstance(error, WriterProcessDied) and "took no byte of step 1" in str(error)
    _within(30, writer.flush)
