"""Early writeback of local shard files: the ranges handed to the kernel, and that nothing else changes."""

import os

import pytest

from ckpt import storage as storage_module
from ckpt import write_behind
from ckpt.storage import Storage
from ckpt.write_behind import WriteBehindFile


def test_every_written_byte_is_queued_once_in_order(tmp_path, monkeypatch):
    queued = []
    monkeypatch.setattr(write_behind, "_start_writeback", lambda fd, start, length, flags: queued.append(
        (start, length, flags)) or 0)
    path = tmp_path / "shard.bin"
    with open(path, "wb") as raw:
        f = WriteBehindFile(raw, every=100)
        for size in (60, 60, 30, 250, 10):
            f.write(b"x" * size)
    # Queued once 100 bytes piled up since the last request: after 120 and 400; the 10-byte tail is left to fsync.
    assert queued == [(0, 120, 2), (120, 280, 2)]
    assert f.calls == 2 and os.path.getsize(path) == 410


def test_the_kernel_accepts_the_request(tmp_path):
    if write_behind._start_writeback is None:
        pytest.skip("sync_file_range exists only on Linux")
    with open(tmp_path / "f.bin", "wb") as f:
        f.write(b"y" * 8192)
        f.flush()
        assert write_behind._start_writeback(f.fileno(), 0, 8192, 2) == 0


def test_local_shard_writes_go_through_it_where_o_direct_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_module, "open_direct", lambda path: None)  # tmpfs, say: see ckpt.direct_io
    queued = []
    monkeypatch.setattr(write_behind, "_start_writeback", lambda *args: queued.append(args[1:3]) or 0)
    monkeypatch.setattr(write_behind, "WRITE_BEHIND_BYTES", 1 << 20)
    storage = Storage(f"file://{tmp_path}/job")
    with storage.atomic_writer(storage.path("s.bin")) as f:
        assert isinstance(f, WriteBehindFile)
        f.write(bytes(range(256)) * 4096 * 3)
    assert storage.read(storage.path("s.bin")) == bytes(range(256)) * 4096 * 3
    assert queued == [(0, 3 << 20)]
