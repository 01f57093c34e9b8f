"""`undying data prepare` to and from the real S3 server: an input read from s3:// by byte
ranges, shards and the manifest written there (the manifest by conditional create), and
`TokenDataset` reading token ranges back with ranged GETs. The units run in this process
(Ray Data's run is tests/ray/test_data_prepare.py; nothing here depends on it)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from ckpt.storage_errors import data_read_retry
from orchestrator.cli.data import execute
from orchestrator.cli.main import main
from tests._corpus import documents, expected_stream, train_tokenizer, write_corpus
from tests._tokens import counting_tokens, write_token_dataset
from trainer.config import DataConfig
from trainer.tokens import TokenDataset

pytestmark = pytest.mark.s3


def test_prepare_to_s3_and_read_back(capsys, monkeypatch, s3_backend, tmp_path):
    monkeypatch.setattr(execute, "RayDataExecutor", lambda address: execute.run_serial)
    docs = documents(60, seed=5)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", docs)
    inputs = [p for p, _ in write_corpus(tmp_path / "in", docs)]
    fs = s3_backend.server.filesystem()
    remote_jsonl = f"{s3_backend.url}/inputs/part.jsonl"
    fs.put_file(str(inputs[2]), remote_jsonl)
    args = [*map(str, inputs[:2]), remote_jsonl, str(inputs[3]), "--tokenizer", str(tokenizer),
            "--out", f"{s3_backend.url}/tokens", "--shard-tokens", "40", *s3_backend.cli_options()]

    assert main(["data", "prepare", *args]) == 0, capsys.readouterr().err
    capsys.readouterr()
    ds = TokenDataset(f"{s3_backend.url}/tokens", s3_backend.storage_options)
    tokens, ends = expected_stream(tokenizer, docs)
    assert len(ds.manifest.shards) >= 4 and ds.manifest.inputs[2] == remote_jsonl
    assert np.array_equal(ds.read(0, ds.n_tokens), tokens)
    assert np.array_equal(ds.read(37, 101), tokens[37:138])
    assert np.array_equal(ds.document_bounds(), ends)
    spans = [(0, 100), (37, 101), (ds.n_tokens - 5, 5)]  # a step's windows, one across shards: one batch of GETs
    assert all(np.array_equal(got, tokens[s:s + n]) for got, (s, n) in zip(ds.read_many(spans), spans, strict=True))
    assert ds.damaged_shards() == []  # the driver's check lists the shards' sizes on S3 too
    assert main(["data", "prepare", *args]) == 0
    assert capsys.readouterr().out.startswith(f"already prepared: {s3_backend.url}/tokens")

    fs.pipe_file(f"{s3_backend.url}/tokens/{ds.manifest.shards[0].name}.tokens", b"\x00" * 6)
    damage = (f"{ds.manifest.shards[0].name}.tokens is 6 bytes where the manifest says "
              f"{ds.manifest.shards[0].n_tokens * ds.dtype.itemsize}")
    assert ds.damaged_shards() == [damage]
    assert main(["data", "prepare", *args]) == 2  # a damaged committed dataset is not "already prepared"
    assert damage in capsys.readouterr().err


def test_a_data_store_that_stops_answering_is_waited_out_and_read_intact(caplog, monkeypatch, s3_backend):
    """The server is frozen (SIGSTOP: connections open, no answer) for 4 s; the client's 1 s read
    timeout turns that into transient errors, which the rank's data retry waits out."""
    url = f"{s3_backend.url}/tokens"
    write_token_dataset(url, counting_tokens(3000, 97), 97, storage_options=s3_backend.storage_options)
    impatient = {**s3_backend.storage_options,
                 "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}
    retry = data_read_retry(DataConfig(source="tokens", path=url, read_retry_s=60.0))
    ds = TokenDataset(url, impatient, retry=retry)
    monkeypatch.setattr(ds.fs, "retries", 1)  # s3fs's own retries (5 by default) would hide the outage
    pid = s3_backend.server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(4.0, os.kill, (pid, signal.SIGCONT))
    try:
        started = time.monotonic()
        resume.start()
        with caplog.at_level(logging.WARNING, logger="ckpt.storage_errors"):
            got = ds.read(1500, 700)
        waited = time.monotonic() - started
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    assert np.array_equal(got, counting_tokens(3000, 97)[1500:2200])
    assert waited >= 3.5, waited
    assert "data.read_retry_s" not in caplog.text and "retrying for up to 60 s" in caplog.text
