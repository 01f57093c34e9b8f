"""Load a Hugging Face Llama's weights into any layout: each rank reads only its slices' bytes.

Protocol: a rank starting a job whose spec names `model.from_hf`, and that has no committed
checkpoint to restore, calls `read_hf_slices(url, engine_slices, model_cfg)` with the
`model/...` slices of `engine.wanted_slices()` and hands the result to `engine.load_weights`.
The safetensors headers (ckpt.safetensors_source) play the manifest's part: the reshard
planner (ckpt.reshard) maps this rank's slices to byte ranges, `ckpt.fetch` reads them in
parallel, and `ckpt.reader.assemble` casts them to the engine's dtype (bf16 weights into fp32
master weights). No collective, no other rank involved, so any dp x tp x pp layout loads the
same values.

Every tensor of the directory is accounted for against the whole model (not only this rank's
part): a tensor undying has no parameter for, a parameter the directory lacks, or a shape
that differs is an error naming it, never a silently dropped or misplaced weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ckpt.fetch import READ_THREADS, fetch
from ckpt.reader import assemble
from ckpt.reshard import plan_reads
from ckpt.safetensors_source import SafetensorsEntry, directory_entries
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry
from trainer.config import ModelConfig
from trainer.hf_names import from_hf, to_hf
from trainer.model import GPT
from trainer.state_slices import TensorSlice

PREFIX = "model/"


def model_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model for `cfg` and its shape (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_directory(entries: dict[str, SafetensorsEntry], cfg: ModelConfig, url: str) -> None:
    """ValueError unless the directory's tensors are exactly the model's parameters, shapes equal."""
    shapes = model_parameter_shapes(cfg)
    for hf_name, entry in sorted(entries.items()):
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # some exporters write the tied head too; the embedding is the parameter
        try:
            name = from_hf(hf_name)
        except KeyError as err:
            raise ValueError(f"model.from_hf={url!r}: {err.args[0]}; it would be dropped") from None
        if name not in shapes:
            raise ValueError(f"model.from_hf={url!r}: holds {hf_name}, which this model ({cfg.n_layers} layers, "
                             f"tie_embeddings={cfg.tie_embeddings}) has no parameter for")
        if not getattr(torch, entry.dtype).is_floating_point:
            raise ValueError(f"model.from_hf={url!r}: {hf_name} is {entry.dtype}, not a floating-point weight")
        if tuple(entry.shape) != shapes[name]:
            raise ValueError(f"model.from_hf={url!r}: {hf_name} has shape {entry.shape}, the model's {name} "
                             f"is {list(shapes[name])}")
    missing = sorted(to_hf(name) for name in shapes if to_hf(name) not in entries)
    if missing:
        raise ValueError(f"model.from_hf={url!r}: no tensor {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def read_hf_slices(url: str, wanted: Sequence[TensorSlice], cfg: ModelConfig, *,
                   storage_options: dict | None = None, threads: int = READ_THREADS,
                   retry: ReadRetry | None = None, on_bytes=None) -> list[TensorSlice]:
    """`wanted` ("model/<name>" slices of any layout) filled from the Hugging Face directory `url`;
    `on_bytes(n, total)` follows the reads (ckpt.fetch.fetch). `retry`: one budget for the store's
    transient failures of the headers' reads (read again whole: they are small) and the slices'."""
    storage, retry = Storage(url.rstrip("/"), storage_options or {}), retry or ReadRetry()
    entries = retry.call(lambda: directory_entries(storage), f"{url}: the safetensors headers")
    check_directory(entries, cfg, url)
    targets = []
    for piece in wanted:
        if not piece.name.startswith(PREFIX):
            raise ValueError(f"{piece.name}: only model parameters load from a Hugging Face directory")
        targets.append(replace(piece, name=to_hf(piece.name.removeprefix(PREFIX))))
    plan = plan_reads(entries, targets)
    filled = assemble(targets, plan, fetch(storage, None, plan.reads, threads=threads, retry=retry,
                                                   on_bytes=on_bytes))
    return [replace(got, name=piece.name) for piece, got in zip(wanted, filled, strict=True)]
