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
that differs is an error naming it, never a silently dropped or misplaced weight. As
transformers loads them: the rotary tables old checkpoints hold (recomputed from config.json) are
not weights, and a tied model's head stored alone stands for its embedding. A tied model's
directory holding a head other than its embedding (`differing_tied_head`, read once by the
driver's check) is refused: transformers 5 would load that head untied, undying would drop it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import torch

from ckpt.fetch import READ_THREADS, fetch
from ckpt.reader import assemble
from ckpt.reshard import plan_reads
from ckpt.safetensors_source import SafetensorsEntry, directory_entries, read_elements
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry
from trainer.config import ModelConfig
from trainer.hf_names import from_hf, to_hf
from trainer.model import GPT
from trainer.state_slices import TensorSlice

PREFIX = "model/"
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Buffers transformers recomputes from config.json and drops on load (checkpoints saved before mid-2023 hold them).
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_COMPARE_BYTES = 64 << 20  # a tied head is compared with its embedding this many bytes at a time


def model_entries(entries: dict[str, SafetensorsEntry], cfg: ModelConfig) -> dict[str, SafetensorsEntry]:
    """The directory's tensors as the model's weights: recomputed buffers left out, and under tied
    embeddings a head stored without the embedding standing for it (transformers 5 ties either way)."""
    kept = {name: entry for name, entry in entries.items() if not _DERIVED.fullmatch(name)}
    if cfg.tie_embeddings and HEAD in kept and EMBEDDING not in kept:
        kept[EMBEDDING] = kept.pop(HEAD)
    return kept


def differing_tied_head(storage: Storage, entries: dict[str, SafetensorsEntry], cfg: ModelConfig) -> bool:
    """Whether a tied model's directory (`entries`: directory_entries) also holds an lm_head.weight other
    than its embedding: a merge or a fine-tune whose config.json says tied when it is not. Reads both
    tensors, a slice at a time, only when both are there (old conversions store an equal copy)."""
    if not (cfg.tie_embeddings and HEAD in entries and EMBEDDING in entries):
        return False
    head, embedding = entries[HEAD], entries[EMBEDDING]
    if head.shape != embedding.shape:
        return True
    dtypes = getattr(torch, head.dtype), getattr(torch, embedding.dtype)
    sizes = [dtype.itemsize for dtype in dtypes]
    count = head.chunks[0].nbytes // sizes[0]
    step = _COMPARE_BYTES // max(sizes)
    for start in range(0, count, step):
        n = min(step, count - start)
        pieces = [read_elements(storage, entry, start, n, size)
                  for entry, size in zip((head, embedding), sizes, strict=True)]
        if dtypes[0] == dtypes[1]:
            if pieces[0] != pieces[1]:
                return True
        elif not torch.equal(*(torch.frombuffer(bytearray(piece), dtype=dtype).float()
                               for piece, dtype in zip(pieces, dtypes, strict=True))):
            return True
    return False


def model_parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model for `cfg` and its shape (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_directory(entries: dict[str, SafetensorsEntry], cfg: ModelConfig, url: str) -> None:
    """ValueError unless the directory's tensors (`model_entries` of them) are exactly the model's
    parameters, shapes equal."""
    shapes = model_parameter_shapes(cfg)
    entries = model_entries(entries, cfg)
    for hf_name, entry in sorted(entries.items()):
        if hf_name == HEAD and cfg.tie_embeddings:
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
    entries = model_entries(entries, cfg)
    targets = []
    for piece in wanted:
        if not piece.name.startswith(PREFIX):
            raise ValueError(f"{piece.name}: only model parameters load from a Hugging Face directory")
        targets.append(replace(piece, name=to_hf(piece.name.removeprefix(PREFIX))))
    plan = plan_reads(entries, targets)
    filled = assemble(targets, plan, fetch(storage, None, plan.reads, threads=threads, retry=retry,
                                                   on_bytes=on_bytes))
    return [replace(got, name=piece.name) for piece, got in zip(wanted, filled, strict=True)]
