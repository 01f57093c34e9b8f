"""`model.from_hf` on the real S3 server: the spec reads config.json, the driver's check the
safetensors headers and a rank its slices, all with `model.storage_options`; a wrong secret is
refused before any rank starts, naming that field."""

from __future__ import annotations

import pytest
import torch

from orchestrator.rank.state import load_pretrained
from orchestrator.spec.data_check import data_problems
from orchestrator.spec.job_spec import validate_spec
from orchestrator.spec.problems import SpecError
from tests._hf import engine_from_hf, save_hf
from trainer.config import DataConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

pytestmark = pytest.mark.s3


def _spec(url: str, options: dict, tmp_path):
    return validate_spec({"name": "hf-s3", "model": {"from_hf": url, "storage_options": options},
                          "data": {"source": "synthetic", "seq_len": 16},
                          "train": {"steps": 3, "global_batch": 2, "micro_batch": 1},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt"}})


def test_pretrained_weights_on_s3_load_with_the_model_storage_options(s3_backend, tmp_path):
    save_hf(tmp_path / "hf")
    url = f"{s3_backend.url}/pretrained"
    s3_backend.server.filesystem().put(f"{tmp_path / 'hf'}/", url, recursive=True)
    spec = _spec(url, s3_backend.storage_options, tmp_path)
    assert data_problems(spec) == []  # the driver's check read the safetensors headers there
    engine = Engine(spec.model, DataConfig(seq_len=16), TrainConfig(steps=3, global_batch=2, micro_batch=1),
                    ParallelConfig(), rank=0, world_size=1)
    load_pretrained(spec, engine)
    local = engine_from_hf(tmp_path / "hf").model.state_dict()
    loaded = engine.model.state_dict()
    assert loaded.keys() == local.keys() and all(torch.equal(loaded[k], local[k]) for k in local)

    wrong = {**s3_backend.storage_options, "secret": "not-the-secret"}
    with pytest.raises(SpecError, match=r"model\.from_hf.*check the URL and model\.storage_options"):
        _spec(url, wrong, tmp_path)


def test_export_ships_a_tokenizer_kept_on_s3_read_with_the_command_s_options(s3_backend, tmp_path):
    import hashlib

    from orchestrator.cli.main import main
    from tests._corpus import documents, train_tokenizer
    from tests._hf import commit

    save_hf(tmp_path / "hf")
    tok = train_tokenizer(tmp_path / "tokenizer.json", documents(20, seed=1))
    url = f"{s3_backend.url}/tokenizer"
    s3_backend.server.filesystem().put_file(str(tok), f"{url}/tokenizer.json")
    recorded = {"url": f"{url}/tokenizer.json", "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck", tokenizer=recorded)
    argv = ["ckpt", "export", f"file://{tmp_path}/ck", "--format", "hf", "--out", str(tmp_path / "out")]
    assert main([*argv, *s3_backend.cli_options()]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == tok.read_bytes()
