"""A small random Hugging Face Llama saved by transformers, loaded into an engine, and committed as a
checkpoint: the fixtures of the Hugging Face import/export and eval tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from ckpt.writer import ShardWriter
from orchestrator.rank.state import load_pretrained
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


def save_hf(path, tie=False, vocab_size=96, **save_kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=500000.0,
                         rope_scaling=dict(SCALING), tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, **save_kw)
    return model


def engine_from_hf(path) -> Engine:
    cfg = ModelConfig(from_hf=str(path))
    train = TrainConfig(steps=3, global_batch=2, micro_batch=1, lr=1e-2)
    engine = Engine(cfg, DataConfig(seq_len=16), train, ParallelConfig(), rank=0, world_size=1)
    spec = SimpleNamespace(model=cfg, checkpoint=SimpleNamespace(read_retry_s=0.0))  # what it reads of a spec
    load_pretrained(spec, engine)  # as a rank does: into its live tensors
    return engine


def commit(engine: Engine, root, tokenizer: dict | None = None) -> Catalog:
    """`engine`'s state committed as a checkpoint under `root`; `tokenizer`: what a job on prepared
    data records of its tokenizer ({"url", "sha256", "token_ids"})."""
    catalog = Catalog(Storage(f"file://{root}", {}))
    receipts = []
    step = engine.next_step
    ShardWriter(catalog.storage, 0, lambda r, extra: receipts.append(r), lambda s, e: None,
                async_save=False).save(step, engine.state_slices(), {})
    catalog.commit(job="j", step=step, generation=0, layout={}, spec_hash="h", receipts=receipts,
                   state={"engine": engine.state_meta(), "model": engine.model_config.architecture(),
                          "seq_len": engine.data_config.seq_len, **({"tokenizer": tokenizer} if tokenizer else {})})
    return catalog


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out
