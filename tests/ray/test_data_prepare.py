"""`undying data prepare` as a user runs it: the real command on an embedded local Ray, its units
as Ray Data tasks, over .txt + .jsonl + .parquet inputs and a BPE tokenizer trained here.

The shards' bytes must equal a one-process `tokenizers` loop over the same documents, and the
manifest the one the same units commit when run one by one in-process; a run whose manifest
and two `.done` markers are gone resumes and commits the same manifest; a rerun is "already
prepared" and other inputs are refused (neither starts Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.data import execute
from orchestrator.cli.main import main
from tests._corpus import documents, expected_stream, train_tokenizer, write_corpus
from trainer.tokens import TokenDataset

pytestmark = pytest.mark.ray

UNDYING = str(Path(sys.executable).parent / "undying")


def undying(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([UNDYING, "data", "prepare", *argv], capture_output=True, text=True, timeout=timeout)


def stream_bytes(out: Path) -> bytes:
    ds = TokenDataset(str(out))
    return b"".join((out / f"{s.name}.tokens").read_bytes() for s in ds.manifest.shards)


def test_prepare_on_ray_data_equals_one_process_tokenization_and_resumes(tmp_path, monkeypatch):
    docs = documents(90, seed=3)
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", docs)
    inputs = [str(p) for p, _ in write_corpus(tmp_path / "in", docs)]
    out = tmp_path / "out"
    common = [*inputs, "--tokenizer", str(tokenizer), "--shard-tokens", "50"]
    argv = [*common, "--out", str(out)]

    first = undying(*argv)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Traceback" not in first.stderr and "data prepare: " in first.stderr  # the progress line
    tokens, ends = expected_stream(tokenizer, docs)
    assert stream_bytes(out) == tokens.astype("<u2").tobytes()
    ds = TokenDataset(str(out))
    assert len(ds.manifest.shards) >= 4 and (ds.document_bounds() == ends).all()
    manifest = (out / "manifest.json").read_bytes()
    # The same units run one after another in this process commit the very same manifest.
    monkeypatch.setattr(execute, "RayDataExecutor", lambda address: execute.run_serial)
    assert main(["data", "prepare", *common, "--out", str(tmp_path / "serial")]) == 0
    assert (tmp_path / "serial" / "manifest.json").read_bytes() == manifest

    (out / "manifest.json").unlink()
    for name in ("shard-000000.done", "shard-000002.done"):
        (out / name).unlink()
    # The resume runs in this process (the executor does not change what resumes; one Ray start
    # per test keeps the suite's time): the two units are redone, the rest kept, the same manifest.
    assert main(["data", "prepare", *argv]) == 0
    assert (out / "manifest.json").read_bytes() == manifest
    assert len(list(out.glob("*.done"))) == len(ds.manifest.shards)

    again = undying(*argv)
    assert again.returncode == 0 and again.stdout.startswith("already prepared: ")
    other = undying(inputs[0], "--tokenizer", str(tokenizer), "--out", str(out))
    assert other.returncode == 2 and "already holds a dataset prepared from other inputs" in other.stderr
    assert "Traceback" not in other.stderr
