"""The job's token ids against the tokenizer of the pretrained weights it starts from.

Ids mean words only under their tokenizer. A Hugging Face model directory (`model.from_hf`)
usually holds the tokenizer its weights were trained with (tokenizer.json); a dataset prepared
with another one, or a text file's bytes fed as ids (`data.source: text`), would fine-tune those
weights on other words behind the same numbers, which no loss curve shows as an error. So, before
any rank starts, every dataset of the job is checked against it:

  * the same tokenizer.json bytes (the SHA-256 its manifest records): the same tokenizer;
  * else the same vocabulary (token -> id, added tokens too) as the tokenizer the dataset names,
    read where its manifest says it came from: the same tokenizer saved again (transformers'
    `save_pretrained` and newer `tokenizers` releases rewrite the file);
  * else, where that tokenizer cannot be read, a vocabulary of another size is refused, and one
    of the same size is let through with a warning (nothing here can tell them apart);
  * otherwise refused, naming the dataset's field and the command that prepares it with the
    model's tokenizer.

A directory without tokenizer.json (one exported from a job on text, or weights alone) checks
nothing here: the datasets' vocabularies are still checked against model.vocab_size.

Protocol: orchestrator.spec.data_check.data_problems calls `tokenizer_problems(spec, opened)`
once, with every dataset it read, when `model.from_hf` is set.
"""

from __future__ import annotations

import logging

import fsspec

from orchestrator.spec.job_spec import JobSpec, Problem
from trainer.tokens.format import sha256_hex

log = logging.getLogger(__name__)


def _read(url: str, options: dict) -> bytes:
    fs, path = fsspec.core.url_to_fs(url, **options)
    return fs.cat_file(path)


def _vocabulary(text: bytes) -> dict[str, int]:
    """token -> id of a tokenizer.json, added tokens too (as `undying data prepare` sizes it)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text.decode("utf-8")).get_vocab(with_added_tokens=True)


def tokenizer_problems(spec: JobSpec, opened: list) -> list[Problem]:
    """Problems of the datasets `opened` ((field, trainer.tokens.reader.TokenDataset)) and of a text
    source against `model.from_hf`'s tokenizer.json; none when the directory holds none."""
    url = f"{spec.model.from_hf.rstrip('/')}/tokenizer.json"
    try:
        model_json = _read(url, spec.model.storage_options)
        model_vocab = _vocabulary(model_json)
    except FileNotFoundError:
        return []
    except Exception as err:  # noqa: BLE001 (unreadable or not a tokenizer: the weights' own check names the store)
        return [Problem("model.from_hf", f"{url} does not read as a Hugging Face tokenizer ({type(err).__name__}: "
                                         f"{err}); fix or remove it")]
    fix = f"`undying data prepare ... --tokenizer {spec.model.from_hf}`"
    if spec.data.source == "text":
        return [Problem("data.source", f"'text' feeds a file's bytes as token ids (0-255), which mean other tokens "
                                       f"to the weights of model.from_hf (its tokenizer is {url}); prepare the text "
                                       f"with that tokenizer ({fix}) and use source 'tokens'")]
    model_sha, problems = sha256_hex(model_json), []
    for field, ds in opened:
        manifest = ds.manifest
        if manifest.tokenizer_sha256 == model_sha:
            continue
        same = _same_vocabulary(manifest.tokenizer, spec.data.storage_options, model_vocab, ds.vocab_size, field)
        if not same:
            problems.append(Problem(field, f"was prepared with another tokenizer ({manifest.tokenizer}, SHA-256 "
                                           f"{manifest.tokenizer_sha256[:12]}...) than model.from_hf's ({url}, "
                                           f"{model_sha[:12]}...): its ids would mean other words to the pretrained "
                                           f"weights; prepare it with that tokenizer ({fix})"))
    return problems


def same_vocabulary(first: str, second: str, options: dict) -> bool:
    """Whether the tokenizer.json files two datasets name (their manifests' `tokenizer`) hold one vocabulary:
    a re-saved copy (`save_pretrained`, a newer `tokenizers` release) is other bytes with the same ids. False
    when either cannot be read now (nothing then shows the ids agree)."""
    try:
        return _vocabulary(_read(first, options)) == _vocabulary(_read(second, options))
    except Exception as err:  # noqa: BLE001 (gone, moved, the store's client, no longer a tokenizer)
        log.info("the tokenizers %s and %s could not be compared (%s: %s)", first, second, type(err).__name__, err)
        return False


def _same_vocabulary(source: str, options: dict, model_vocab: dict[str, int], data_vocab_size: int,
                     field: str) -> bool:
    """Whether the tokenizer a dataset names (`source`, as its manifest recorded it) has the model's
    vocabulary; by its size alone, with a warning, when that tokenizer cannot be read now."""
    try:
        return _vocabulary(_read(source, options)) == model_vocab
    except Exception as err:  # noqa: BLE001 (gone, moved, the store's client, no longer a tokenizer)
        model_size = max(model_vocab.values()) + 1
        if model_size != data_vocab_size:
            return False
        log.warning("%s: its tokenizer %s cannot be read to compare with model.from_hf's (%s: %s); its vocabulary "
                    "has the same size (%d), so it is taken as the same tokenizer", field, source,
                    type(err).__name__, err, model_size)
        return True
