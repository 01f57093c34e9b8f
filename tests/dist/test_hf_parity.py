"""Hugging Face weights in every layout: a random GQA Llama built by transformers gives the same
logits and loss in dp2 x tp2 and in pp2 as in transformers itself; trained in dp2 x tp2 x pp2
with ZeRO-3, it exports as a directory transformers loads with every key, whose logits equal
undying's forward of that checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from ckpt.catalog import Catalog  # noqa: E402
from ckpt.hf_export import export_hf  # noqa: E402
from ckpt.hf_import import read_hf_slices  # noqa: E402
from ckpt.manifest import ShardReceipt  # noqa: E402
from ckpt.reader import load_checkpoint  # noqa: E402
from ckpt.storage import Storage  # noqa: E402
from ckpt.writer import ShardWriter  # noqa: E402
from tests._hf import save_hf  # noqa: E402
from tests._tokens import write_token_dataset  # noqa: E402
from tests.dist._launch import run_ranks  # noqa: E402
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from trainer.engine import Engine  # noqa: E402
from trainer.evaluation import eval_windows, loss_of_model  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.tokens.reader import TokenDataset  # noqa: E402

SEQ, WINDOWS = 16, 8
IDS = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(5))


def hf_engine(rank, world_size, hf_dir, parallel, data_url=None) -> Engine:
    cfg = ModelConfig(from_hf=hf_dir)
    data = DataConfig(source="tokens", path=data_url, seq_len=SEQ) if data_url else DataConfig(seq_len=SEQ)
    train = TrainConfig(steps=4, global_batch=8, micro_batch=2, lr=1e-2)
    engine = Engine(cfg, data, train, parallel, rank=rank, world_size=world_size)
    wanted = [p for p in engine.wanted_slices() if p.name.startswith("model/")]
    engine.load_weights(read_hf_slices(hf_dir, wanted, cfg))
    return engine


def forward_and_evaluate(rank, world_size, hf_dir, data_url, layouts):
    out = []
    for parallel in layouts:
        engine = hf_engine(rank, world_size, hf_dir, parallel)
        logits = None
        if engine.pipeline is None:
            with torch.no_grad():
                logits = engine.model(IDS)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        windows = eval_windows(TokenDataset(data_url), SEQ, WINDOWS)
        out.append((logits, engine.evaluate(windows)))
        del engine
    return out


def hf_loss(hf, windows) -> float:
    with torch.no_grad():
        logits = hf(torch.stack([w[:-1] for w in windows])).logits
    return float(F.cross_entropy(logits.flatten(0, 1).double(), torch.stack([w[1:] for w in windows]).flatten(),
                                 reduction="mean"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf = save_hf(root / "hf")
    tokens = np.random.default_rng(0).integers(0, 96, size=4000)
    data = write_token_dataset(root / "val", tokens, vocab_size=96, shard_tokens=700)
    return root, hf, str(root / "hf"), str(data)


def test_hf_logits_and_loss_equal_transformers_in_dp2_tp2_and_pp2(prepared):
    _, hf, hf_dir, data_url = prepared
    layouts = [ParallelConfig(dp=2, tp=2, zero=3), ParallelConfig(dp=2, pp=2, schedule="gpipe")]
    ranks = run_ranks(forward_and_evaluate, 4, (hf_dir, data_url, layouts), timeout_s=300)
    with torch.no_grad():
        want_logits = hf(IDS).logits
    want_loss = hf_loss(hf, eval_windows(TokenDataset(data_url), SEQ, WINDOWS))
    for rank_out in ranks:
        tp_logits, (tp_sum, tp_tokens) = rank_out[0]
        torch.testing.assert_close(tp_logits, want_logits, rtol=0, atol=1e-5)
        assert tp_tokens == WINDOWS * SEQ and tp_sum / tp_tokens == pytest.approx(want_loss, rel=1e-5)
        _, (pp_sum, pp_tokens) = rank_out[1]
        assert pp_tokens == WINDOWS * SEQ and pp_sum / pp_tokens == pytest.approx(want_loss, rel=1e-5)


def train_and_save(rank, world_size, hf_dir, data_url, ckpt_url, steps):
    parallel = ParallelConfig(dp=2, tp=2, pp=2, zero=3, schedule="1f1b")
    engine = hf_engine(rank, world_size, hf_dir, parallel, data_url)
    losses = [engine.train_step().loss for _ in range(steps)]
    receipts = []
    writer = ShardWriter(Storage(ckpt_url), rank, lambda r, extra: receipts.append(r), lambda s, e: None,
                         async_save=False)
    writer.save(steps, engine.state_slices(), {})
    return receipts[0].model_dump(), engine.state_meta(), losses


@pytest.mark.heavy
def test_hf_to_3d_zero3_training_to_hf_round_trip(prepared):
    root, hf, hf_dir, data_url = prepared
    ckpt_url = f"file://{root}/ck"
    steps = 3
    ranks = run_ranks(train_and_save, 8, (hf_dir, data_url, ckpt_url, steps), timeout_s=600)
    catalog = Catalog(Storage(ckpt_url))
    cfg = ModelConfig(from_hf=hf_dir)
    catalog.commit(job="j", step=steps, generation=0, layout={"dp": 2, "tp": 2, "pp": 2}, spec_hash="h",
                   receipts=[ShardReceipt.model_validate(r) for r, _, _ in ranks],
                   state={"engine": ranks[0][1], "model": cfg.architecture(), "seq_len": SEQ})
    assert all(np.isfinite(ranks[0][2]))
    export_hf(catalog, steps, str(root / "out"))
    loaded, info = AutoModelForCausalLM.from_pretrained(root / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tensors, _ = load_checkpoint(catalog, steps, [n for n in catalog.read_manifest(steps).tensors
                                                  if n.startswith("model/")])
    ours = build_model(cfg, seed=0)
    ours.load_state_dict({n.removeprefix("model/"): t for n, t in tensors.items()}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(IDS).logits, ours(IDS), rtol=0, atol=1e-5)
        assert not torch.allclose(hf(IDS).logits, ours(IDS))  # the export holds the trained weights
    windows = eval_windows(TokenDataset(data_url), SEQ, WINDOWS)
    assert loss_of_model(ours, windows).loss == pytest.approx(hf_loss(loaded, windows), rel=1e-5)
