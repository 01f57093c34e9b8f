"""A job's datasets are checked against the tokenizer of the pretrained weights it starts from
(`model.from_hf`'s tokenizer.json): the same bytes or the same vocabulary pass, another tokenizer
or a text file's bytes are refused by field before any rank starts."""

import json
import logging

import numpy as np
import pytest

from orchestrator.spec.data_check import data_problems
from orchestrator.spec.job_spec import validate_spec
from tests._tokens import write_token_dataset
from trainer.tokens.format import sha256_hex

pytest.importorskip("transformers")
from tokenizers import Tokenizer, models  # noqa: E402

from tests._hf import save_hf  # noqa: E402


def _tokenizer(path, words: list[str]) -> str:
    """A word-level tokenizer.json of `words` (ids in order) at `path`; its SHA-256."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.save(str(path))
    return sha256_hex(path.read_bytes())


WORDS = ["<unk>", "</s>"] + [f"w{i}" for i in range(62)]  # 64 ids, within the model's 96


@pytest.fixture
def pretrained(tmp_path):
    save_hf(tmp_path / "hf")
    return tmp_path / "hf", _tokenizer(tmp_path / "hf" / "tokenizer.json", WORDS)


def _job(tmp_path, hf, data_path, **data):
    return validate_spec({"name": "j", "model": {"from_hf": str(hf)}, "train": {"steps": 10, "global_batch": 4},
                          "checkpoint": {"url": f"file://{tmp_path}/ck"},
                          "data": {"source": "tokens", "seq_len": 16, "path": str(data_path), **data},
                          "eval": {"path": str(tmp_path / "val"), "every_steps": 5}})


def _dataset(path, tokenizer_path, sha: str, vocab: int = 64):
    tokens = np.arange(3000) % vocab
    if path.name == "val":  # held out: other tokens than training's
        tokens = tokens[::-1]
    write_token_dataset(path, tokens, vocab, tokenizer_sha256=sha, tokenizer=str(tokenizer_path))


def test_datasets_prepared_with_the_pretrained_tokenizer_pass(tmp_path, pretrained):
    hf, sha = pretrained
    _dataset(tmp_path / "train", hf / "tokenizer.json", sha)
    _dataset(tmp_path / "val", hf / "tokenizer.json", sha)
    assert data_problems(_job(tmp_path, hf, tmp_path / "train")) == []


def test_the_same_tokenizer_saved_again_passes_by_its_vocabulary(tmp_path, pretrained):
    hf, sha = pretrained
    saved_again = tmp_path / "resaved.json"
    saved_again.write_text(json.dumps(json.loads((hf / "tokenizer.json").read_text()), indent=4))
    other_bytes = sha256_hex(saved_again.read_bytes())
    assert other_bytes != sha
    _dataset(tmp_path / "train", saved_again, other_bytes)
    _dataset(tmp_path / "val", saved_again, other_bytes)
    assert data_problems(_job(tmp_path, hf, tmp_path / "train")) == []


def test_a_dataset_from_another_tokenizer_is_refused_by_field_with_the_command_that_fixes_it(tmp_path, pretrained):
    hf, sha = pretrained
    other = tmp_path / "other.json"
    other_sha = _tokenizer(other, ["<unk>", "</s>"] + [f"v{i}" for i in range(62)])  # as many ids, other words
    _dataset(tmp_path / "train", other, other_sha)
    _dataset(tmp_path / "val", other, other_sha)  # the two agree with each other, not with the weights
    problems = data_problems(_job(tmp_path, hf, tmp_path / "train"))
    assert [p.field for p in problems] == ["data.path", "eval.path"]
    assert "another tokenizer" in problems[0].message and f"--tokenizer file://{hf}`" in problems[0].message


def test_an_unreadable_dataset_tokenizer_is_judged_by_its_vocabulary_size(tmp_path, pretrained, caplog):
    hf, _ = pretrained
    gone = tmp_path / "gone" / "tokenizer.json"  # prepared elsewhere: the path is not here
    _dataset(tmp_path / "train", gone, "1" * 64, vocab=50)
    _dataset(tmp_path / "val", gone, "1" * 64, vocab=50)
    problems = data_problems(_job(tmp_path, hf, tmp_path / "train"))
    assert [p.field for p in problems] == ["data.path", "eval.path"] and "another tokenizer" in problems[0].message
    _dataset(tmp_path / "train", gone, "1" * 64, vocab=64)
    _dataset(tmp_path / "val", gone, "1" * 64, vocab=64)
    with caplog.at_level(logging.WARNING):
        assert data_problems(_job(tmp_path, hf, tmp_path / "train")) == []
    assert "cannot be read to compare" in caplog.text and "same size (64)" in caplog.text


def test_a_text_source_is_refused_for_weights_that_come_with_a_tokenizer(tmp_path):
    hf = tmp_path / "bytes-hf"
    save_hf(hf, vocab_size=256)
    _tokenizer(hf / "tokenizer.json", WORDS)
    text = tmp_path / "corpus.txt"
    text.write_text("hello world " * 100)
    job = validate_spec({"name": "j", "model": {"from_hf": str(hf)}, "train": {"steps": 10,
                         "global_batch": 4}, "checkpoint": {"url": f"file://{tmp_path}/ck"},
                         "data": {"source": "text", "path": str(text), "seq_len": 16}})
    [problem] = data_problems(job)
    assert problem.field == "data.source" and "prepare the text with that tokenizer" in problem.message
    (hf / "tokenizer.json").unlink()  # weights alone (an export of a job on text): nothing to compare
    assert data_problems(job) == []


def test_datasets_of_one_tokenizer_saved_twice_train_and_validate_together(tmp_path, pretrained):
    # Between a job's own datasets too, a re-saved tokenizer (other bytes, the same ids) is the same one;
    # a tokenizer of other words, or one that cannot be read now to show it, is refused.
    hf, sha = pretrained
    saved_again = tmp_path / "resaved.json"
    saved_again.write_text(json.dumps(json.loads((hf / "tokenizer.json").read_text()), indent=4))
    _dataset(tmp_path / "train", hf / "tokenizer.json", sha)
    _dataset(tmp_path / "val", saved_again, sha256_hex(saved_again.read_bytes()))
    assert data_problems(_job(tmp_path, hf, tmp_path / "train")) == []
    other = _tokenizer(tmp_path / "other.json", list(reversed(WORDS)))
    _dataset(tmp_path / "b", tmp_path / "other.json", other)
    _dataset(tmp_path / "c", tmp_path / "gone.json", "2" * 64)
    for name in ("b", "c"):
        mixture = {"source": "tokens", "seq_len": 16, "mixture": [{"path": str(tmp_path / "train"), "weight": 1},
                                                                  {"path": str(tmp_path / name), "weight": 1}]}
        job = validate_spec({"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 10, "global_batch": 4},
                             "checkpoint": {"url": f"file://{tmp_path}/ck"}, "data": mixture})
        [problem] = data_problems(job)
        assert problem.field == "data.mixture[1].path" and "another tokenizer" in problem.message, name
