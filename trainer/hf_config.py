"""Hugging Face `config.json` <-> `ModelConfig`, for Llama-architecture models, exactly or not at all.

Protocol: `ModelConfig` calls `merge_hf_architecture(data)` while validating a `model:` section
that names `from_hf` (the driver, once, before any rank starts; `undying plan` too), and
`ckpt export --format hf` calls `hf_config_of(model)` to write one. Both directions accept
the two spellings transformers writes: 4.x (`rope_theta` and `rope_scaling` at the top level)
and 5.x (`rope_parameters` holding both).

A key undying cannot represent exactly is refused with `ValueError`, naming the key: a model
trained from weights whose architecture was silently approximated is the failure the users of
every converter complain about (dropped biases, misread rope scaling). Keys that describe no
computation (token ids, dtype, cache use, provenance) are accepted and ignored.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import fsspec

# Architecture keys -> ModelConfig fields.
_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
    "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_seq_len", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
}
# Keys whose value must be this for the model to be the one undying computes.
_REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
             "model_type": "llama"}
# Keys that change nothing in the forward pass.
_IGNORED = {
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "use_cache",
    "transformers_version", "initializer_range", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "id2label", "label2id", "tokenizer_class", "prefix", "task_specific_params",
    "problem_type", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "chunk_size_feed_forward", "finetuning_task", "cross_attention_hidden_size", "sep_token_id",
    "decoder_start_token_id", "output_scores", "return_dict_in_generate", "pruned_heads", "model_name",
    # Read by no Llama forward of transformers: pretraining_tp (4.x split its matmuls, the same sums;
    # 5.x ignores it), tools' marks (SmolLM's is_llama_config, rope_interleaved; Unsloth's; a 4.4x save's).
    "pretraining_tp", "is_llama_config", "rope_interleaved", "unsloth_version", "_attn_implementation_autoset",
}
_ROPE_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
# Dimensions a config.json must give, and what transformers' LlamaConfig assumes for the rest.
_REQUIRED_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LLAMA_DEFAULTS = {"max_seq_len": 2048, "norm_eps": 1e-6, "tie_embeddings": False}
# A Hub model id: organisation/name, as `hf download` takes it.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Keys of `model:` that may differ from the weights' config without changing what the weights mean.
OVERRIDABLE = {"max_seq_len", "dropout", "max_position_embeddings"}


def refuse_a_hub_id(value: str) -> None:
    """ValueError when `value` (model.from_hf as written) is a Hub model id ("meta-llama/Llama-3.2-1B")
    and no such local directory exists: undying reads a model directory, not the Hub, and the
    plain "no config.json" under the working directory would not say what to do instead."""
    if "://" not in value and _HUB_ID.fullmatch(value) and not os.path.exists(value):
        raise ValueError(f"{value!r} is not a directory here and looks like a Hugging Face Hub model id; undying "
                         f"reads a model directory (a path or any fsspec URL): download it first (`hf download "
                         f"{value} --local-dir DIR`) and give DIR, or a copy of it on your object store")


def read_hf_config(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parsed config.json of the Hugging Face model directory at `url` (path or fsspec URL),
    read with `storage_options` (model.storage_options)."""
    path = url.rstrip("/") + "/config.json"
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"model.from_hf: no config.json at {path}; give a Hugging Face model directory") from None
    except Exception as err:  # noqa: BLE001 (any store's client error: credentials, an option, a missing library)
        raise ValueError(f"model.from_hf: cannot read {path} ({type(err).__name__}: {err}); check the URL and "
                         "model.storage_options") from None
    try:
        config = json.loads(data.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError is one
        raise ValueError(f"model.from_hf: {path} is not UTF-8 JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model.from_hf: {path} is not a JSON object")
    return config


def _rope_of(source: dict, key: str, theta: float) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) of one spelling's rope settings; its own `rope_theta`
    wins over `theta` (the top-level key's, or the default), as transformers reads it."""
    if not isinstance(source, dict):
        raise ValueError(f"config key '{key}': {source!r} is not a JSON object")
    theta = _positive_number(f"{key}.rope_theta", source.get("rope_theta", theta))
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type == "default":
        unknown = set(source) - {"rope_type", "type", "rope_theta"}
        if unknown:
            raise ValueError(f"config key '{key}.{sorted(unknown)[0]}': not used by rope_type 'default'")
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"config key '{key}.rope_type': {rope_type!r} is not supported (undying computes 'default' "
                         "and 'llama3' rotary embeddings exactly); use a Llama-3 model")
    unknown = set(source) - _ROPE_KEYS - {"rope_type", "type", "rope_theta"}
    if unknown:
        raise ValueError(f"config key '{key}.{sorted(unknown)[0]}': not part of llama3 rope scaling")
    absent = sorted(_ROPE_KEYS - set(source))
    if absent:  # transformers versions disagree on these defaults: only an explicit value is exact
        raise ValueError(f"config key '{key}.{absent[0]}': missing; llama3 rope scaling needs it given")
    return theta, {"rope_type": "llama3", **{k: source[k] for k in sorted(_ROPE_KEYS)}}


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from the 5.x spelling (`rope_parameters`), the 4.x one
    (top-level `rope_theta`, `rope_scaling`), or both when they agree (what undying exports). A
    theta given twice (the top level and inside a spelling) must be one value: transformers takes
    the inner one, an older reader the outer, so either reading would be some reader's wrong model."""
    top = config.get("rope_theta")
    default = 10000.0 if top is None else _positive_number("rope_theta", top)
    spellings = [(key, config[key]) for key in ("rope_parameters", "rope_scaling") if config.get(key) is not None]
    readings = [_rope_of(source, key, default) for key, source in spellings]
    for (key, source), reading in zip(spellings, readings, strict=True):
        if top is not None and reading[0] != float(top):
            raise ValueError(f"config key 'rope_theta': {top} at the top level, {source['rope_theta']} in {key}; "
                             "keep one value")
    if len(readings) == 2 and readings[0] != readings[1]:
        raise ValueError("config key 'rope_scaling': differs from rope_parameters; keep one of them")
    return readings[0] if readings else (float(default), None)


def architecture_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keys for a Llama `config.json`; ValueError naming the first key that does not fit."""
    for key, value in _REQUIRED.items():
        if key in config and config[key] != value:
            raise ValueError(f"config key {key!r}: {config[key]!r} cannot be represented (undying computes "
                             f"{value!r}); only Llama-architecture models load")
    if "model_type" not in config:
        raise ValueError("config key 'model_type': missing; only Llama-architecture models ('llama') load")
    known = set(_FIELDS) | set(_REQUIRED) | _IGNORED | {"rope_theta", "rope_scaling", "rope_parameters", "head_dim"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"config key {unknown[0]!r}: undying cannot represent it exactly; remove it only if it "
                         "does not change the model")
    missing = [key for key in _REQUIRED_SHAPE if config.get(key) is None]
    if missing:
        raise ValueError(f"config key {missing[0]!r}: missing; a Llama config.json names every dimension")
    _check_values(config)
    # A key left out means LlamaConfig's default, as transformers reads the same file.
    out = {**_LLAMA_DEFAULTS, **{field: config[key] for key, field in _FIELDS.items() if config.get(key) is not None}}
    out.setdefault("n_kv_heads", out["n_heads"])
    out["rope_theta"], out["rope_scaling"] = _rope(config)
    out.update(activation="swiglu", norm="rmsnorm", position="rope")
    head_dim = config.get("head_dim")
    if head_dim is not None and out.get("n_heads") and head_dim * out["n_heads"] != out.get("d_model"):
        raise ValueError(f"config key 'head_dim': {head_dim} x num_attention_heads {out['n_heads']} != hidden_size "
                         f"{out.get('d_model')}; undying's heads split hidden_size evenly")
    return out


def _check_values(config: dict[str, Any]) -> None:
    """Each dimension a positive whole number, the norm's epsilon a positive number, the tie a
    boolean: a string or a null named by its key in config.json, not as the spec field it becomes."""
    # A null kv head count or head_dim means as many as the query heads, and their split (as
    # transformers reads them); other nulls have no meaning.
    for key in ("max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        if key in config and config[key] is None:
            raise ValueError(f"config key {key!r}: null; give its value or remove the key; fix config.json")
    for key in (*_REQUIRED_SHAPE, "num_key_value_heads", "max_position_embeddings", "head_dim"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"config key {key!r}: {value!r} is not a positive whole number; fix config.json")
    if config.get("rms_norm_eps") is not None:
        _positive_number("rms_norm_eps", config["rms_norm_eps"])
    if config.get("tie_word_embeddings") is not None and not isinstance(config["tie_word_embeddings"], bool):
        raise ValueError(f"config key 'tie_word_embeddings': {config['tie_word_embeddings']!r} is not true or false; "
                         "fix config.json")


def _positive_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"config key {key!r}: {value!r} is not a positive number; fix config.json")
    return float(value)


def merge_hf_architecture(data: dict[str, Any]) -> dict[str, Any]:
    """The `model:` mapping `data` with the architecture of `data['from_hf']` filled in.

    Explicit keys may only restate the weights' architecture, except OVERRIDABLE ones (a
    shorter training context, dropout); anything else is refused, naming it."""
    try:
        options = data.get("storage_options")  # not a mapping: the field's own validation says so
        arch = architecture_from_hf(read_hf_config(data["from_hf"], options if isinstance(options, dict) else None))
    except ValueError as err:
        raise ValueError(f"from_hf={data['from_hf']!r}: {err}") from None
    for key, value in data.items():
        if value is None or key in ("from_hf", *OVERRIDABLE) or key not in arch and key != "preset":
            continue
        if key == "preset" or arch[key] != value:
            raise ValueError(f"model.{key}={value!r} contradicts the config.json of from_hf "
                             f"({arch.get(key, 'no preset')!r}); remove model.{key}")
    # The weights' declared context outlives a shorter training context (ModelConfig keeps the longer).
    return {**arch, "max_position_embeddings": arch["max_seq_len"], **{k: v for k, v in data.items() if v is not None}}


def hf_config_of(model) -> dict[str, Any]:
    """The `config.json` of a Llama-architecture ModelConfig, rotary settings in both spellings
    (5.x `rope_parameters`, 4.x `rope_theta` / `rope_scaling`); ValueError naming the field that
    makes it another architecture."""
    for field, want in (("activation", "swiglu"), ("norm", "rmsnorm"), ("position", "rope")):
        if getattr(model, field) != want:
            raise ValueError(f"model.{field} is {getattr(model, field)!r}; Hugging Face's Llama needs {want!r}, so "
                             "this checkpoint exports only with --format safetensors")
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        rope = {**model.rope_scaling.model_dump(), "rope_theta": model.rope_theta}
    config = {key: getattr(model, field) for key, field in _FIELDS.items()}
    config["max_position_embeddings"] = model.max_position_embeddings
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **config, "head_dim": model.head_dim,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "pretraining_tp": 1, "rope_parameters": rope,
        # The 4.x spelling too, read by transformers 4.x and by other loaders of config.json.
        "rope_theta": model.rope_theta, "rope_scaling": None if model.rope_scaling is None else rope,
    }
