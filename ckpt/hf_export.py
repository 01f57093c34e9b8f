"""Export a committed checkpoint as a Hugging Face model directory that transformers loads as is.

Protocol: `undying ckpt export URL --format hf --out DIR` calls `export_hf(catalog, step, DIR,
...)` once. It writes, into a temporary sibling directory that is renamed to DIR only when
every file is complete (a failed export never leaves a directory that looks like a model):

    config.json                      LlamaForCausalLM, from the model config the manifest carries
    generation_config.json           bos/eos token ids
    model.safetensors                or model-0000k-of-0000n.safetensors + model.safetensors.index.json
                                     when the weights exceed `max_shard_bytes`
    tokenizer.json (+ its config)    the tokenizer the job trained with, when known

Names follow trainer.hf_names; the dtype is the checkpoint's (fp32 master weights) unless
`dtype` casts it. Memory stays bounded by one read batch whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid

import fsspec

from ckpt.catalog import Catalog
from ckpt.export import Exported, plan_export, write_safetensors, write_tensors
from ckpt.manifest import Manifest
from trainer.config import ModelConfig
from trainer.hf_config import hf_config_of
from trainer.hf_names import to_hf

PREFIX = "model/"
INDEX_NAME = "model.safetensors.index.json"
# A tokenizer's files beside its tokenizer.json: its config, special tokens, and chat templates
# (transformers 5 saves a chat model's template as chat_template.jinja, no longer in tokenizer_config.json).
# A SentencePiece tokenizer's tokenizer.model goes too: its slow tokenizer and converters read it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "added_tokens.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # a tokenizer's named templates besides the default one
# What a generation_config.json holds besides decoding settings: a copy records its own.
GENERATION_METADATA = ("transformers_version", "_from_model_config")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"


def model_config_of(manifest: Manifest) -> ModelConfig:
    """The model architecture a checkpoint was trained with; ValueError when it does not say."""
    raw = manifest.state.get("model")
    if raw is None:
        raise ValueError("this checkpoint does not record its model config (written by an older release), which "
                         "this needs; its weights can still be exported with --format safetensors")
    return ModelConfig.model_validate(raw)


def shard_plan(tensors: list[Exported], max_shard_bytes: int) -> list[list[Exported]]:
    """Tensors grouped into files of at most `max_shard_bytes` (a larger tensor gets a file of its own)."""
    shards: list[list[Exported]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def data_provenance(data, model: ModelConfig | None = None) -> dict:
    """What a checkpoint's manifest records of the tokenizer its prepared data used (the controller
    adds it at each commit; `ckpt export --format hf` ships those tokenizer files, `export_hf`'s
    `tokenizer_url`): {} for synthetic and text data. Its special token ids are `model.from_hf`'s
    (`pretrained_settings`) with the data's end-of-document id among the end ids; its decoding
    settings, `model.from_hf`'s."""
    if data.source != "tokens":
        return {}
    from trainer.tokens.reader import TokenDataset

    first = data.path or data.mixture[0].path
    manifest = TokenDataset(first, data.storage_options).manifest
    token_ids, generation = pretrained_settings(model) if model is not None and model.from_hf else ({}, {})
    ends = token_ids.get("eos_token_id")
    ends = list(ends) if isinstance(ends, list) else [] if ends is None else [ends]
    ends += [manifest.eos_id] if manifest.eos_id not in ends else []
    token_ids["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    record = {"url": manifest.tokenizer, "sha256": manifest.tokenizer_sha256, "token_ids": token_ids}
    return {"tokenizer": {**record, "generation": generation} if generation else record}


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def pretrained_settings(model: ModelConfig) -> tuple[dict, dict]:
    """What `model.from_hf` declares for generation, each file read once: its special token ids
    (config.json's, then generation_config.json's, where a chat model lists its end-of-turn ids,
    which `generate()` stops at) and its decoding settings (generation_config.json's temperature,
    top_p, do_sample..., without token ids and metadata). An export of a job that started from it
    carries them on: without the ids transformers falls back to LlamaConfig's bos 1 and a chat model
    would not stop at the end of a turn; without the settings it would not generate as it did."""
    config, generation = _pretrained_json(model, "config.json"), _pretrained_json(model, "generation_config.json")
    ids: dict = {}
    for found in (config, generation):
        ids.update({key: found[key] for key in TOKEN_ID_KEYS if found.get(key) is not None})
    return ids, {key: value for key, value in generation.items() if key not in TOKEN_ID_KEYS + GENERATION_METADATA}


def _pretrained_json(model: ModelConfig, name: str) -> dict:
    """`model.from_hf`'s JSON file `name`; {} when it has none (a generation config is optional; the
    spec read config.json already)."""
    try:
        with fsspec.open(f"{model.from_hf.rstrip('/')}/{name}", "rb", **model.storage_options) as f:
            found = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _copy_tokenizer(tokenizer_url: str, out_dir: str, storage_options: dict, sha256: str | None) -> list[str]:
    """Copy the tokenizer at `tokenizer_url` into `out_dir`: a tokenizer file of any name (as
    `undying data prepare --tokenizer` takes one, and the checkpoint records) copied as
    tokenizer.json, or a directory's tokenizer.json, with the other TOKENIZER_FILES and the
    CHAT_TEMPLATE_DIR found beside it;
    read with `storage_options`. ValueError when there is no tokenizer there, or when `sha256` (the
    one the job trained with, as the checkpoint records it) is given and the file is another."""
    try:  # reaching the store: its protocol, the options, the credentials
        fs, path = fsspec.core.url_to_fs(tokenizer_url, **storage_options)
        path = path.rstrip("/")
        directory = fs.isdir(path)
        base = path if directory else path.rsplit("/", 1)[0]
        sources = {"tokenizer.json": f"{base}/tokenizer.json" if directory else path}
        sources.update({name: f"{base}/{name}" for name in TOKENIZER_FILES if name != "tokenizer.json"})
        present = {name: source for name, source in sources.items() if fs.exists(source)}
        templates = f"{base}/{CHAT_TEMPLATE_DIR}"
        if fs.isdir(templates):  # its named chat templates, one .jinja file each
            present.update({f"{CHAT_TEMPLATE_DIR}/{found.rstrip('/').rsplit('/', 1)[-1]}": found
                            for found in fs.ls(templates, detail=False) if fs.isfile(found)})
    except Exception as err:  # noqa: BLE001 (the store's client, whatever it raises for these)
        where = tokenizer_url.removesuffix("/tokenizer.json")
        raise ValueError(f"the tokenizer at {where} cannot be reached with the storage options given "
                         f"({type(err).__name__}: {err}); pass --tokenizer with a copy they reach") from None
    if "tokenizer.json" not in present:
        raise ValueError(f"no tokenizer at {tokenizer_url} (a tokenizer.json, or a directory holding one); pass "
                         "--tokenizer with the tokenizer the job trained with")
    for name, source in present.items():  # a read or a local write failing now is the store's or the disk's
        os.makedirs(os.path.dirname(os.path.join(out_dir, name)), exist_ok=True)
        with fs.open(source, "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
    with open(os.path.join(out_dir, "tokenizer.json"), "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    if sha256 is not None and got != sha256:
        raise ValueError(f"{present['tokenizer.json']} is not the tokenizer the job trained with (SHA-256 "
                         f"{got[:12]}..., the checkpoint records {sha256[:12]}...); pass --tokenizer with that one")
    return list(present)


def _write_configs(out_dir: str, model: ModelConfig, dtype: str, token_ids: dict,
                   generation: dict | None = None) -> None:
    """config.json, and generation_config.json: the pretrained model's decoding settings with the
    token ids, or (none recorded) what transformers derives from config.json."""
    config = {**hf_config_of(model), "dtype": dtype, "torch_dtype": dtype, **token_ids}  # 5.x and 4.x keys
    generation = {**(generation or {"_from_model_config": True}), **token_ids}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)


def save_hf(model: ModelConfig, weights: dict, out_dir: str, token_ids: dict | None = None) -> None:
    """Write in-memory weights (undying parameter names -> tensors) as a Hugging Face directory:
    how a model made outside a checkpoint (a new initialisation, a conversion) becomes a
    `model.from_hf` starting point."""
    os.makedirs(out_dir, exist_ok=True)
    hf_config_of(model)
    tensors = {to_hf(name): t.detach().contiguous() for name, t in weights.items()}
    write_tensors(os.path.join(out_dir, "model.safetensors"), tensors, {"format": "pt"})
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    _write_configs(out_dir, model, dtype, token_ids or {})


def export_hf(catalog: Catalog, step: int, out_dir: str, *, dtype: str | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer_url: str | None = None,
              tokenizer_sha256: str | None = None, storage_options: dict | None = None,
              token_ids: dict | None = None, generation: dict | None = None, on_bytes=None) -> list[str]:
    """Write checkpoint `step` as a Hugging Face directory at `out_dir` (which must not exist or be
    empty); returns the files written. ValueError when the model is not a Llama architecture, or the
    tokenizer is missing or not the one `tokenizer_sha256` names (checked before any weight is
    written; read with `storage_options`). `on_bytes(n, total)` follows the weight bytes written."""
    manifest = catalog.read_manifest(step)
    model = model_config_of(manifest)
    names = {stored: to_hf(stored[len(PREFIX):]) for stored in sorted(manifest.tensors) if stored.startswith(PREFIX)}
    hf_config_of(model)  # refuses a non-Llama architecture before anything is written
    tensors = plan_export(manifest, names, dtype)
    shards = shard_plan(tensors, max_shard_bytes)
    files = _file_names(len(shards))
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        copied = _copy_tokenizer(tokenizer_url, tmp, storage_options or {}, tokenizer_sha256) if tokenizer_url else []
        metadata = {"format": "pt", "undying.job": manifest.job, "undying.step": str(step)}
        total = sum(t.nbytes for t in tensors)
        for file, shard in zip(files, shards, strict=True):
            write_safetensors(catalog, step, os.path.join(tmp, file), shard, metadata,
                              on_bytes=None if on_bytes is None else lambda n: on_bytes(n, total), manifest=manifest)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                     "weight_map": {t.name: file for file, shard in zip(files, shards, strict=True) for t in shard}}
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        stored_dtype = dtype or manifest.tensors[next(iter(names))].dtype
        _write_configs(tmp, model, stored_dtype, token_ids or {}, generation)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked by the caller); a non-empty one raises here
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(files + ([INDEX_NAME] if len(files) > 1 else []) + ["config.json", "generation_config.json"]
                  + copied)
