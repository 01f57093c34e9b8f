"""A parameter-server fine-tune: its servers start from `model.from_hf`'s weights, as a collective
rank does, and its checkpoints record the data's tokenizer and the pretrained special token ids,
as a collective job's do (an export ships them)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.reader import read_manifest
from ckpt.storage import Storage
from orchestrator.cli.ps_run import supervision
from orchestrator.rank.state import load_pretrained
from orchestrator.spec.job_spec import validate_spec
from paramserver.checkpoint import save_ps_checkpoint
from paramserver.lockstep import build_in_process, run_lockstep
from tests._hf import save_hf
from tests._tokens import write_token_dataset
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.model import build_model
from trainer.state_slices import assemble

DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=4, global_batch=4, micro_batch=1, grad_clip=None, lr=1e-2)
SMALL_PIECES = 2000  # bytes: cuts the embedding and the MLP matrices into row bands over the servers


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("tie", [False, True])
def test_servers_start_from_the_pretrained_weights_and_bsp_trains_as_the_collective_fine_tune(tmp_path, tie):
    save_hf(tmp_path / "hf", tie=tie)
    model = ModelConfig(from_hf=str(tmp_path / "hf"))
    reference_engine = Engine(model, DATA, TRAIN, ParallelConfig(), rank=0, world_size=1)
    load_pretrained(SimpleNamespace(model=model, checkpoint=SimpleNamespace(read_retry_s=0.0)), reference_engine)
    weights = {f"model/{name}": value.detach().clone() for name, value in reference_engine.model.named_parameters()}
    setup = build_in_process(model, DATA, TRAIN, ParallelConfig(dp=2, mode="ps", servers=3, consistency="bsp"),
                             SMALL_PIECES)
    at_start = assemble([piece for server in setup.servers for piece in server.state_slices()])
    for name, value in weights.items():  # the pretrained weights, not the seed's random initialisation
        assert torch.equal(at_start[name], value), name
    assert not torch.equal(weights["model/tok_emb.weight"], build_model(model, TRAIN.seed).tok_emb.weight)

    reference = [reference_engine.train_step().loss for _ in range(TRAIN.steps)]
    losses, _ = run_lockstep(setup, TRAIN.steps)
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < 1e-5, (losses, reference)

def test_a_ps_checkpoint_records_the_data_s_tokenizer_and_the_pretrained_special_ids(tmp_path):
    save_hf(tmp_path / "hf")  # config.json: bos 1, eos 2 (LlamaConfig's)
    write_token_dataset(tmp_path / "tokens", np.arange(3000) % 90, 90, eos_id=3, tokenizer="file:///tok.json")
    spec = validate_spec({
        "name": "ps-fine-tune",
        "model": {"from_hf": str(tmp_path / "hf")},
        "data": {"source": "tokens", "path": str(tmp_path / "tokens"), "seq_len": 16},
        "train": {"steps": 2, "global_batch": 4, "micro_batch": 1, "grad_clip": None},
        "parallel": {"mode": "ps", "dp": 2, "servers": 2, "consistency": "bsp"},
        "checkpoint": {"url": str(tmp_path / "ckpt"), "every_steps": 2},
    })
    checkpoints, _ = supervision(spec)
    setup = build_in_process(spec.model, spec.data, spec.train, spec.parallel, SMALL_PIECES)
    run_lockstep(setup, 2)
    save_ps_checkpoint(setup.servers, spec.checkpoint_root, 2, job=checkpoints.job)
    recorded = read_manifest(Catalog(Storage(spec.checkpoint_root)), 2).state["tokenizer"]
    assert recorded["url"] == "file:///tok.json"
    assert recorded["token_ids"] == {"bos_token_id": 1, "eos_token_id": [2, 3]}  # the model's end, and the data's
