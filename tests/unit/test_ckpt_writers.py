"""make_writer: the config's writer choice, each writer implementing CheckpointWriter, storage setup applied; a
caller blocked on a save keeps its signs of life (on_wait ticks, written bytes) with either writer."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from chaos.config import ArmedFault
from chaos.storage_faults import install_on
from ckpt.config import CheckpointConfig
from ckpt.process_writer import ProcessShardWriter
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from ckpt.writers import CheckpointWriter, make_writer
from trainer.state_slices import whole


def _save_one(writer: CheckpointWriter) -> list:
    receipts = []
    writer.on_receipt = lambda receipt, extra: receipts.append(receipt)
    writer.save(5, [whole("w", torch.arange(6, dtype=torch.float32))], {})
    writer.flush()
    return receipts


def test_thread_and_process_writers_both_implement_the_protocol(tmp_path):
    url = f"file://{tmp_path}"
    kinds = {}
    for choice in ("thread", "process"):
        config = CheckpointConfig(url=url, writer=choice)
        writer = make_writer(config, url, 0, lambda r, e: None, lambda step, err: None, tag=choice)
        assert isinstance(writer, CheckpointWriter)
        kinds[choice] = type(writer)
        receipts = _save_one(writer)
        assert [r.step for r in receipts] == [5]
    assert kinds == {"thread": ShardWriter, "process": ProcessShardWriter}


def test_storage_setup_runs_on_the_thread_writers_storage(tmp_path):
    url = f"file://{tmp_path}"
    seen = []

    def setup(storage: Storage, notify) -> None:
        seen.append(storage.url)
        notify({"type": "fault"})

    notices = []
    make_writer(CheckpointConfig(url=url, writer="thread"), url, 0, lambda r, e: None, lambda s, e: None,
                storage_setup=setup, notify=notices.append).flush()
    assert seen == [Storage(url).url] and notices == [{"type": "fault"}]


def _latency(delay_s: float) -> functools.partial:
    """A storage setup that delays every shard write by `delay_s` (chaos storage_latency, as a rank installs it)."""
    fault = ArmedFault(kind="storage_latency", op="write", path="*/shard-*", delay_s=delay_s, id=0)
    return functools.partial(install_on, faults=[fault], seed=0, started=time.time())


@pytest.mark.parametrize("choice,async_save", [("thread", True), ("thread", False), ("process", True)])
def test_a_caller_blocked_on_a_slow_save_keeps_ticking_and_the_bytes_are_counted(tmp_path, choice, async_save):
    url = f"file://{tmp_path}"
    config = CheckpointConfig(url=url, writer=choice, **{"async": async_save})
    writer = make_writer(config, url, 0, lambda r, e: None, lambda step, err: None, tag=choice,
                         storage_setup=_latency(1.5))
    ticks: list[tuple[float, int]] = []
    writer.on_wait = lambda: ticks.append((time.monotonic(), writer.written_bytes))
    writer.wait_tick_s = 0.2
    state = torch.arange(6000, dtype=torch.float32)
    writer.save(5, [whole("w", state)], {})
    writer.flush()
    assert writer.written_bytes == state.numel() * 4  # every byte the store took, once
    # The caller waited (in flush, or in a synchronous save) through the 1.5 s delay, ticking every 0.2 s.
    assert len(ticks) >= 4 and ticks[-1][0] - ticks[0][0] >= 0.8


def test_write_slices_reports_each_piece_the_store_took(tmp_path, monkeypatch):
    import ckpt.shards

    monkeypatch.setattr(ckpt.shards, "PROGRESS_BYTES", 1000)
    storage, pieces = Storage(f"file://{tmp_path}"), []
    state = [whole("a", torch.arange(600, dtype=torch.float32)), whole("b", torch.arange(10, dtype=torch.int64))]
    receipt = ckpt.shards.write_slices(storage, 3, 0, state, 0.0, on_progress=pieces.append)
    assert pieces == [1000, 1000, 400, 80] and sum(pieces) == 2480 <= receipt.nbytes  # the file pads between chunks


@pytest.mark.parametrize("choice", ["thread", "process"])
def test_a_save_left_behind_by_an_abort_is_abandoned_unreported_and_its_staging_freed(tmp_path, choice):
    # The rank leaves its generation while a stalled store holds its save: after the settle the
    # save is stopped (the thread writer at the store's next piece, the process writer's child
    # killed), never reported, and its staging freed, instead of lingering with each generation.
    from ckpt.writers import abandon_stragglers

    url, reports = f"file://{tmp_path}", []
    writer = make_writer(CheckpointConfig(url=url, writer=choice), url, 0, lambda r, e: reports.append(r),
                         lambda step, err: reports.append(err), tag=choice, storage_setup=_latency(3.0))
    writer.save(5, [whole("w", torch.arange(6000, dtype=torch.float32))], {})
    started = time.monotonic()
    assert abandon_stragglers([writer], settle_s=0.3) == [writer] and writer.abandoned
    assert writer._idle.wait(10.0)  # the save is over
    if choice == "process":
        assert time.monotonic() - started < 2.5  # its child was killed, not waited out
        deadline = time.monotonic() + 5.0
        while writer._buffer is not None and time.monotonic() < deadline:  # freed by the flush thread
            time.sleep(0.05)
        assert writer._buffer is None
    time.sleep(0.5)
    assert reports == []  # neither a receipt nor an error: its generation is over
