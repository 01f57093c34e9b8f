"""How `undying data prepare` encodes a document's special tokens: through the tokenizer's
post-processor by default, as transformers' tokenizer(text) does (a Llama tokenizer's BOS first),
and special tokens written in the text as their characters unless --parse-special-tokens (chat
data's markup), with a warning when the first documents write one as text. The reference is
transformers' own fast tokenizer over the same tokenizer.json."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, processors
from transformers import PreTrainedTokenizerFast

from tests._corpus import documents, train_tokenizer
from tests.unit.test_data_prepare import Recorder, prepare
from trainer.tokens import TokenDataset

CHAT = "<|user|>hello there<|eot|>"


@pytest.fixture
def executor(monkeypatch):
    from orchestrator.cli.data import execute

    monkeypatch.setattr(execute, "RayDataExecutor", lambda address: Recorder())


def _llama_like(tmp_path, template: str = "<s> $A"):
    """A tokenizer.json whose post-processor frames each text (`template`), with chat special tokens."""
    path = train_tokenizer(tmp_path / "base" / "tokenizer.json", documents(40, seed=3))
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens(["<s>", "<|user|>", "<|eot|>"])
    ids = {t: tokenizer.token_to_id(t) for t in ("<s>", "</s>")}
    tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=list(ids.items()))
    out = tmp_path / "tok" / "tokenizer.json"
    out.parent.mkdir()
    tokenizer.save(str(out))
    return out


def _inputs(tmp_path, texts):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _stream(out) -> list[int]:
    ds = TokenDataset(str(out))
    return ds.read(0, ds.n_tokens).tolist()


def test_documents_are_encoded_as_transformers_does_with_the_bos_and_chat_markup_parsed_on_request(
        capsys, executor, tmp_path):
    tok = _llama_like(tmp_path)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tok))  # the real client: tokenizer(text).input_ids
    eos = theirs.convert_tokens_to_ids("</s>")
    texts = ["plain text first", CHAT, "and a last one"]
    inputs = _inputs(tmp_path, texts)
    code, _, err = prepare(capsys, inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "default"))
    assert code == 0, err
    parsed = [i for t in texts for i in [*theirs(t).input_ids, eos]]
    as_text = [i for t in texts for i in [*theirs(t, split_special_tokens=True).input_ids, eos]]
    assert _stream(tmp_path / "default") == as_text != parsed  # BOS first; the markup is its characters
    assert "warning" in err and "'<|user|>'" in err and "--parse-special-tokens" in err
    assert f"the line at byte {len(json.dumps({'text': texts[0]})) + 1}" in err  # the chat record, named

    code, _, err = prepare(capsys, inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "chat"),
                           "--parse-special-tokens")
    assert code == 0 and "warning" not in err, err
    assert _stream(tmp_path / "chat") == parsed and theirs.convert_tokens_to_ids("<|eot|>") in parsed

    code, _, err = prepare(capsys, inputs, "--tokenizer", str(tok), "--out", str(tmp_path / "bare"),
                           "--no-add-special-tokens", "--parse-special-tokens")
    assert code == 0, err
    assert _stream(tmp_path / "bare") == [i for t in texts for i in [*theirs(t, add_special_tokens=False).input_ids,
                                                                       eos]]
    assert TokenDataset(str(tmp_path / "bare")).manifest.add_special_tokens is False


def test_a_post_processor_that_ends_documents_with_eos_gets_no_second_one(capsys, executor, tmp_path):
    tok = _llama_like(tmp_path, template="<s> $A </s>")
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tok))
    texts = ["one document", "", "another"]  # an empty one too: no document, not BOS and EOS alone
    assert prepare(capsys, _inputs(tmp_path, texts), "--tokenizer", str(tok), "--out", str(tmp_path / "o"))[0] == 0
    assert _stream(tmp_path / "o") == [i for t in texts if t for i in theirs(t).input_ids]
    assert TokenDataset(str(tmp_path / "o")).n_documents == 2


def test_other_encoding_flags_at_the_same_out_are_refused_by_name(capsys, executor, tmp_path):
    tok = _llama_like(tmp_path)
    argv = [_inputs(tmp_path, ["some text", "more text"]), "--tokenizer", str(tok), "--out", str(tmp_path / "o")]
    assert prepare(capsys, *argv)[0] == 0
    code, _, err = prepare(capsys, *argv, "--parse-special-tokens")
    assert code == 2 and "--parse-special-tokens off (this run's is on)" in err
    code, _, err = prepare(capsys, *argv, "--no-add-special-tokens")
    assert code == 2 and "--add-special-tokens on (this run's is off)" in err
    assert prepare(capsys, *argv)[0] == 0  # the same flags: already prepared


def test_a_parsed_document_that_writes_its_end_token_gets_no_second_one(capsys, executor, tmp_path):
    tok = _llama_like(tmp_path)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tok))
    eos = theirs.convert_tokens_to_ids("</s>")
    texts = [CHAT + "</s>", "plain"]
    argv = [_inputs(tmp_path, texts), "--tokenizer", str(tok), "--parse-special-tokens"]
    for flags, special in (([], True), (["--no-add-special-tokens"], False)):
        out = tmp_path / f"o{len(flags)}"
        assert prepare(capsys, *argv, "--out", str(out), *flags)[0] == 0
        ids = [theirs(t, add_special_tokens=special).input_ids for t in texts]
        assert _stream(out) == [*ids[0], *ids[1], eos] and ids[0][-1] == eos  # one end each, not two
