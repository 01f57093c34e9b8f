"""`undying data prepare` to and from the real S3 server: an input read from s3:// by byte
ranges, shards and the manifest written there (the manifest by conditional create), and
`TokenDataset` reading token ranges back with ranged GETs. The units run in this process
(Ray Data's run is tests/ray/test_data_prepare.py; nothing here depends on it)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.cli.data import execute
from orchestrator.cli.main import main
from tests._corpus import documents, expected_stream, train_tokenizer, write_corpus
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

    assert main(["data", "prepare", *args]) == 0
    assert capsys.readouterr().out.startswith(f"already prepared: {s3_backend.url}/tokens")
