"""The tokenizer of `undying data prepare`: loaded once on the driver, identified by its hash.

Called by the driver (`prepare.py`) before anything runs. `--tokenizer` is a Hugging Face
`tokenizers` tokenizer.json, or a directory (local or fsspec URL) that holds one. The
driver ships the JSON text to the tasks, which build their own `Tokenizer` from it
(`build_tokenizer`, cached per worker process), so every task encodes with exactly the
bytes whose SHA-256 the manifest records.

The end-of-document token, appended after every document that does not end with it already
(the tokenizer's post-processor's, or one the text wrote and the plan parses), is the first of:
  1. `--eos-token`, when given (it must be in the vocabulary);
  2. the directory's tokenizer_config.json `eos_token`, then config.json `eos_token_id`;
  3. the first of "</s>", "<|endoftext|>", "<eos>" the vocabulary holds.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

from orchestrator.cli.data.sources import open_fs, to_url
from orchestrator.cli.exits import UsageError
from trainer.tokens.format import dtype_for_vocab, sha256_hex

DEFAULT_EOS = ("</s>", "<|endoftext|>", "<eos>")
_cache: dict[str, object] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer as the plan and the manifest record it, and its JSON for the tasks."""

    source: str  # URL of the tokenizer.json read
    json_text: str
    sha256: str
    vocab_size: int  # largest id + 1: what an embedding table needs
    eos_id: int
    eos_token: str

    @property
    def dtype(self) -> str:
        return dtype_for_vocab(self.vocab_size)


def _task_cpus() -> int:
    """CPUs Ray gave the running task (1 by default), or every core outside Ray (run_serial)."""
    try:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except (ImportError, AttributeError):
        pass
    return os.cpu_count() or 1


def build_tokenizer(json_text: str, sha256: str, parse_special: bool = False):
    """A `tokenizers.Tokenizer` for `json_text`, built once per process (tasks reuse workers);
    `parse_special`: special tokens written in a document are their ids (`--parse-special-tokens`)."""
    from tokenizers import Tokenizer

    key = f"{sha256}:{'parse' if parse_special else 'text'}"
    with _cache_lock:
        if key not in _cache:
            # A task holds one CPU (Ray's contract): encode_batch's Rust thread pool, sized on first
            # use, gets that many threads, not every core of the node that other tasks share.
            os.environ.setdefault("RAYON_NUM_THREADS", str(_task_cpus()))
            tokenizer = Tokenizer.from_str(json_text)
            # A training stream holds whole documents: a tokenizer.json saved for inference may
            # truncate to its context or pad to a batch's longest, which would cut documents and
            # put pad ids in the stream (differently with each batch's make-up). And by default a
            # document's text is text: a literal "</s>" in web text is its characters, not a special
            # token (no document boundary the data did not have); chat-formatted data, whose
            # markup is special tokens, asks for them to be parsed.
            tokenizer.no_truncation()
            tokenizer.no_padding()
            tokenizer.encode_special_tokens = not parse_special
            _cache[key] = tokenizer
        return _cache[key]


def load_tokenizer(arg: str, eos_token: str | None, storage_options: dict) -> TokenizerSpec:
    """Read, check and identify the tokenizer at `arg`; UsageError naming the flag and the fix."""
    url = to_url(arg, "--tokenizer")
    try:
        fs, path = open_fs(url, storage_options)
    except (ValueError, ImportError) as err:
        raise UsageError(f"--tokenizer {arg}: unknown or unavailable protocol ({err})") from None
    directory = fs.isdir(path)
    source = f"{url}/tokenizer.json" if directory else url
    try:
        data = fs.cat_file(f"{path}/tokenizer.json" if directory else path)
    except FileNotFoundError:
        what = f"{arg} has no tokenizer.json" if directory else f"{arg}: no such file or directory"
        raise UsageError(f"--tokenizer {what}; give a tokenizer.json or a directory holding one") from None
    try:
        text = data.decode("utf-8")
        tokenizer = build_tokenizer(text, sha256_hex(data))
    except Exception as err:  # tokenizers raises a plain Exception for a file it cannot parse
        raise UsageError(f"--tokenizer {arg}: not a Hugging Face tokenizers tokenizer.json ({_short(err)})") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
        raise UsageError(f"--tokenizer {arg}: the tokenizer has an empty vocabulary")
    config = _directory_config(fs, path) if directory else {}
    eos_token, eos_id = resolve_eos(vocab, eos_token, config)
    return TokenizerSpec(source=source, json_text=text, sha256=sha256_hex(data), vocab_size=max(vocab.values()) + 1,
                         eos_id=eos_id, eos_token=eos_token)


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _directory_config(fs, path: str) -> dict:
    """`eos_token` of tokenizer_config.json and `eos_token_id` of config.json, where present."""
    found: dict = {}
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        try:
            value = json.loads(fs.cat_file(f"{path}/{name}")).get(key)
        except (FileNotFoundError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # older tokenizer_config.json: an AddedToken as a dict
            value = value.get("content")
        if isinstance(value, list):  # config.json may list several end ids; the first ends documents
            value = value[0] if value else None
        if value is not None:
            found[key] = value
    return found


def resolve_eos(vocab: dict[str, int], explicit: str | None, config: dict) -> tuple[str, int]:
    """The (token, id) that ends every document; see the module docstring for the order."""
    if explicit is not None:
        if explicit not in vocab:
            raise UsageError(f"--eos-token {explicit!r}: not in the tokenizer's vocabulary; "
                             "give a token the vocabulary holds")
        return explicit, vocab[explicit]
    token = config.get("eos_token")
    if isinstance(token, str) and token in vocab:
        return token, vocab[token]
    by_id = {i: t for t, i in vocab.items()}
    token_id = config.get("eos_token_id")
    if isinstance(token_id, int) and token_id in by_id:
        return by_id[token_id], token_id
    for token in DEFAULT_EOS:
        if token in vocab:
            return token, vocab[token]
    named = " and its directory names no usable eos_token" if not config else \
        f" and its directory's eos {next(iter(config.values()))!r} is not in it"
    raise UsageError(f"--eos-token: the vocabulary holds none of {', '.join(repr(t) for t in DEFAULT_EOS)}{named}; "
                     "pass --eos-token with the token that ends a document")
