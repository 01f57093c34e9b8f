"""`undying ckpt` against the real S3 server, reached through `--storage-options-file`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ckpt.catalog import Catalog
from ckpt.shards import write_shard
from ckpt.storage import Storage
from orchestrator.cli.main import main
from tests._checkpoints import flip_bit, make_state, save_checkpoint, shard_of
from tests.s3.conftest import cli_options

pytestmark = pytest.mark.s3


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def job(s3_backend):
    catalog = Catalog(Storage(s3_backend.url, s3_backend.storage_options))
    for step in (10, 20, 30):
        save_checkpoint(catalog, step, make_state(step))
    write_shard(catalog.storage, 15, 0, make_state(), blocking_s=0.0)
    return s3_backend, catalog


def test_ls_verify_export_gc_over_s3(capsys, job, tmp_path):
    backend, catalog = job
    opts = backend.cli_options()
    code, out, err = run(capsys, "ls", backend.url, *opts)
    assert code == 0 and not err and "3 committed checkpoint(s)" in out and "steps 15" in out

    code, out, _ = run(capsys, "verify", backend.url, *opts)
    assert code == 0 and out.count(": ok (") == 3

    out_file = tmp_path / "model.safetensors"
    code, out, _ = run(capsys, "export", backend.url, *opts, "--step", "20", "--out", str(out_file))
    assert code == 0
    loaded = load_file(str(out_file))
    expected = {n.removeprefix("model/"): t for n, t in make_state(20).items() if n.startswith("model/")}
    assert set(loaded) == set(expected)
    assert all(loaded[n].dtype == t.dtype and torch.equal(loaded[n], t) for n, t in expected.items())

    code, out, _ = run(capsys, "gc", backend.url, *opts, "--keep", "1")
    assert code == 0 and "deleted committed checkpoints: steps 10, 20" in out and "unfinished saves: steps 15" in out
    assert Catalog(Storage(backend.url, backend.storage_options)).all_steps() == [30]


def test_verify_over_s3_names_the_shard_with_a_flipped_bit(capsys, job):
    backend, catalog = job
    bad_file = shard_of(catalog, 30, "model/w")
    flip_bit(catalog, 30, bad_file)
    code, out, err = run(capsys, "verify", backend.url, *backend.cli_options())
    assert code == 1
    assert "step 30: CORRUPT" in out and bad_file in out and bad_file in err
    assert out.count(": ok (") == 2 and "Traceback" not in err


def test_bad_credentials_and_missing_bucket_exit_2(capsys, job):
    backend, _ = job
    wrong = cli_options(dict(backend.storage_options, secret="not-the-secret"))
    code, _, err = run(capsys, "ls", backend.url, *wrong)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "access denied" in err and "--storage-options-file" in err and "not-the-secret" not in err
    # A credential given as a flag is refused before anything is contacted, and not echoed.
    code, _, err = run(capsys, "ls", backend.url, "--storage-option", "secret=not-the-secret")
    assert code == 2 and "refused, a credential on the command line" in err and "not-the-secret" not in err
    missing = "s3://no-such-bucket-undying/job"
    code, _, err = run(capsys, "verify", missing, *backend.cli_options())
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
