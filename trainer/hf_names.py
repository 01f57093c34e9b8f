"""Parameter names: undying's (trainer/model.py) <-> Hugging Face LlamaForCausalLM's, one to one.

Used by the Hugging Face import (ckpt/hf_import.py: which stored tensor fills which parameter)
and export (ckpt/hf_export.py). Both directions are total on their own names and refuse any
other, so a conversion can neither drop nor misplace a weight silently.
"""

from __future__ import annotations

import re

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_OURS = re.compile(r"blocks\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf(name: str) -> str:
    """Hugging Face name of undying parameter `name` (no "model/" prefix); KeyError for any other."""
    if name in _TOP:
        return _TOP[name]
    match = _OURS.fullmatch(name)
    if match and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
    raise KeyError(f"{name}: no Hugging Face Llama parameter corresponds (a learned position table or a "
                   "gelu MLP has none)")


def from_hf(name: str) -> str:
    """undying parameter name of Hugging Face tensor `name`; KeyError for any other."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = _THEIRS.fullmatch(name)
    if match and match.group(2) in _BLOCK_BACK:
        return f"blocks.{match.group(1)}.{_BLOCK_BACK[match.group(2)]}"
    raise KeyError(f"{name}: not a parameter of Hugging Face's LlamaForCausalLM that undying holds")
