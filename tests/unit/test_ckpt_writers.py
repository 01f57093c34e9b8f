"""make_writer: the config's writer choice, each writer implementing CheckpointWriter, storage setup applied."""

from __future__ import annotations

import torch

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
