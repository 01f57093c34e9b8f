"""Local shard files written with O_DIRECT: exact bytes and length, clean failure, fallbacks."""

from __future__ import annotations

import errno
import os

import pytest

from ckpt import direct_io
from ckpt import storage as storage_module
from ckpt.direct_io import ALIGN_BYTES, DirectFile, open_direct
from ckpt.storage import Storage
from ckpt.write_behind import WriteBehindFile

BUFFER = 4 * ALIGN_BYTES


def _payload(n: int) -> bytes:
    return bytes((i * 7 + i // 251) % 256 for i in range(n))


def _direct_fd(path) -> int:
    fd = open_direct(str(path))
    if fd is None:
        pytest.skip(f"{path.parent} does not accept O_DIRECT")
    return fd


@pytest.mark.parametrize("sizes", [[1], [BUFFER], [BUFFER + 1], [5000, 70000, 3, BUFFER * 2, 123], []])
def test_bytes_and_length_are_exact_whatever_the_write_sizes(tmp_path, sizes):
    data = _payload(sum(sizes))
    path = tmp_path / "shard.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=BUFFER)
    at = 0
    for size in sizes:
        assert f.write(memoryview(data)[at:at + size]) == size
        at += size
    f.finish()
    assert path.read_bytes() == data  # the zero padding of the last aligned write is cut off
    assert f.size == len(data) and f.direct


def test_the_callers_buffer_may_change_after_write_returns(tmp_path):
    path = tmp_path / "shard.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=BUFFER)
    scratch = bytearray(b"a" * 3000)
    for letter in b"abcdefgh":  # the shard writer reuses one gather buffer for every chunk
        scratch[:] = bytes([letter]) * 3000
        f.write(scratch)
    f.finish()
    assert path.read_bytes() == b"".join(bytes([c]) * 3000 for c in b"abcdefgh")


def test_a_device_that_refuses_direct_writes_gets_buffered_io_and_the_same_bytes(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def refusing_direct(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")  # a larger logical block size, say
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_direct)
    data = _payload(3 * BUFFER + 17)
    path = tmp_path / "shard.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=BUFFER)
    f.write(data)
    f.finish()
    assert not f.direct and path.read_bytes() == data
    assert calls[-1] == 17  # buffered from then on: the tail is written as it is, not padded


def test_a_device_refusing_only_the_padded_last_write_still_gets_the_true_length(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def refusing_the_tail(fd, data):
        calls.append(len(data))
        if len(data) % BUFFER and len(calls) == 2:  # the padded tail, after one full buffer
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", refusing_the_tail)
    data = _payload(BUFFER + 100)
    path = tmp_path / "shard.bin"
    f = DirectFile(_direct_fd(path), buffer_bytes=BUFFER)
    f.write(data)
    f.finish()
    assert calls == [BUFFER, ALIGN_BYTES, ALIGN_BYTES]  # the padded tail, refused, then retried buffered
    assert not f.direct and path.read_bytes() == data


def test_an_io_error_reaches_the_writer_and_the_descriptor_is_closed(tmp_path, monkeypatch):
    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "write", full_disk)
    f = DirectFile(_direct_fd(tmp_path / "shard.bin"), buffer_bytes=BUFFER)
    fd = f.fileno()
    with pytest.raises(OSError, match="No space"):
        f.write(b"x" * (3 * BUFFER))  # the second hand-off collects the first one's error
    f.abort()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_o_direct_refused_at_open_means_none(tmp_path, monkeypatch):
    def no_direct(path, flags, mode=0o777):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    assert open_direct(str(tmp_path / "x")) is None


def test_local_atomic_writer_lands_whole_or_not_at_all(tmp_path):
    storage = Storage(f"file://{tmp_path}/job")
    data = _payload(2 * direct_io.BUFFER_BYTES + 4097)
    with storage.atomic_writer(storage.path("s.bin")) as f:
        probe = open_direct(str(tmp_path / "probe"))
        expected = WriteBehindFile if probe is None else DirectFile
        if probe is not None:
            os.close(probe)
        assert isinstance(f, expected)
        f.write(data[:100])
        f.write(data[100:])
    assert storage.read(storage.path("s.bin")) == data

    with pytest.raises(RuntimeError, match="writer died"), storage.atomic_writer(storage.path("t.bin")) as f:
        f.write(data)
        raise RuntimeError("writer died")
    assert sorted(os.listdir(tmp_path / "job")) == ["s.bin"]  # no t.bin, no temporary file left


def test_storage_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_module, "open_direct", lambda path: None)
    storage = Storage(f"file://{tmp_path}/job")
    with storage.atomic_writer(storage.path("s.bin")) as f:
        assert isinstance(f, WriteBehindFile)
        f.write(b"abc")
    assert storage.read(storage.path("s.bin")) == b"abc"


def test_buffers_that_cannot_be_mapped_close_the_descriptor_and_leave_no_file(tmp_path, monkeypatch):
    opened = []

    def tracked(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # (a plain one: this checks the close)
        opened.append(fd)
        return fd

    def no_memory(*args, **kwargs):
        raise MemoryError("cannot map the staging buffers")

    monkeypatch.setattr(storage_module, "open_direct", tracked)
    monkeypatch.setattr(storage_module, "DirectFile", no_memory)
    storage = Storage(f"file://{tmp_path}/job")
    with pytest.raises(MemoryError), storage.atomic_writer(storage.path("s.bin")):
        pass
    try:  # closed, not held (with the disk blocks of its unlinked file) until the process exits
        held = os.readlink(f"/proc/self/fd/{opened[0]}")
    except FileNotFoundError:
        held = ""  # (a number reused since names another file)
    assert str(tmp_path) not in held and os.listdir(tmp_path / "job") == []
