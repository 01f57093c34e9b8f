"""Prepared datasets are checked before any rank starts: readable, within the model's vocabulary,
large enough, and every dataset of the job tokenized with the same tokenizer; a pipeline's
validation windows fit its static shape; a validation is no hang."""

import numpy as np
import pytest

from orchestrator.controller.policies import hang_limit
from orchestrator.spec.data_check import data_problems
from orchestrator.spec.job_spec import SpecError, validate_spec
from tests._tokens import write_token_dataset
from trainer.data import MAX_TEXT_BYTES

TOKENS = np.arange(5000) % 200


def _sparse(path, size: int):
    """A file of `size` bytes that takes no disk space (a hole)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def spec(tmp_path, **sections):
    base = {"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 10, "global_batch": 4},
            "checkpoint": {"url": f"file://{tmp_path}/ck"}}
    return validate_spec({**base, **sections})


def test_a_mixture_or_validation_set_from_another_tokenizer_is_refused_by_field(tmp_path):
    write_token_dataset(tmp_path / "a", TOKENS, 256)
    write_token_dataset(tmp_path / "b", TOKENS[::-1], 256, tokenizer_sha256="1" * 64)
    mixture = {"source": "tokens", "seq_len": 16, "mixture": [{"path": str(tmp_path / "a"), "weight": 1},
                                                              {"path": str(tmp_path / "b"), "weight": 1}]}
    problems = data_problems(spec(tmp_path, data=mixture))
    assert [p.field for p in problems] == ["data.mixture[1].path"] and "another tokenizer" in problems[0].message
    same = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "a")}
    assert data_problems(spec(tmp_path, data=same)) == []
    problems = data_problems(spec(tmp_path, data=same, eval={"path": str(tmp_path / "b"), "every_steps": 5}))
    assert [p.field for p in problems] == ["eval.path"]


def test_a_validation_set_holding_training_tokens_is_refused(tmp_path):
    write_token_dataset(tmp_path / "a", TOKENS, 256)
    write_token_dataset(tmp_path / "copy", TOKENS, 256)  # the same tokens under another name
    trained = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "a")}
    [problem] = data_problems(spec(tmp_path, data=trained, eval={"path": str(tmp_path / "copy"), "every_steps": 5}))
    assert problem.field == "eval.path" and "same tokens as data.path" in problem.message
    assert "kept out of training" in problem.message
    twice = {"source": "tokens", "seq_len": 16, "mixture": [{"path": str(tmp_path / "a"), "weight": 1},
                                                            {"path": str(tmp_path / "copy"), "weight": 2}]}
    [problem] = data_problems(spec(tmp_path, data=twice, eval={"path": str(tmp_path / "copy"), "every_steps": 5}))
    assert problem.field == "eval.path" and "same tokens as data.mixture" in problem.message
    assert data_problems(spec(tmp_path, data=twice)) == []  # a job trained on it must still resume as it was


def test_a_validation_set_prepared_again_from_training_text_is_refused(tmp_path):
    write_token_dataset(tmp_path / "a", TOKENS, 256, inputs=["file:///corpus/train.jsonl", "file:///corpus/web"])
    trained = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "a")}
    for inputs in (["file:///corpus/train.jsonl"], ["file:///corpus/web/part-1.parquet"], ["file:///corpus/"],
                   ["file:///corpus/./train.jsonl"]):
        write_token_dataset(tmp_path / "held", TOKENS[::-1], 256, inputs=inputs, shard_tokens=700)
        [problem] = data_problems(spec(tmp_path, data=trained, eval={"path": str(tmp_path / "held"),
                                                                     "every_steps": 5}))
        assert problem.field == "eval.path" and f"prepared from {inputs[0]}, an input of data.path" in problem.message
    write_token_dataset(tmp_path / "held", TOKENS[::-1], 256, inputs=["file:///corpus/train-held.jsonl"])
    assert data_problems(spec(tmp_path, data=trained, eval={"path": str(tmp_path / "held"), "every_steps": 5})) == []


def test_missing_small_or_too_wide_datasets_name_their_field(tmp_path):
    write_token_dataset(tmp_path / "wide", np.arange(3000) % 1000, 1000)
    data = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "wide")}
    problems = data_problems(spec(tmp_path, data=data, eval={"path": str(tmp_path / "none"), "every_steps": 5}))
    fields = {p.field: p.message for p in problems}
    assert "beyond model.vocab_size = 256" in fields["data.path"]
    assert "run `undying data prepare` first" in fields["eval.path"]
    (tmp_path / "corpus.jsonl").write_text('{"text": "raw, not prepared"}\n')  # a file where a dataset goes
    [problem] = data_problems(spec(tmp_path, data={**data, "path": str(tmp_path / "corpus.jsonl")}))
    assert problem.field == "data.path" and "is a file, not a prepared dataset; prepare it first" in problem.message


@pytest.mark.parametrize(("make", "field", "words"), [
    (lambda d: d / "missing.txt", "data.path", "does not exist"),
    (lambda d: d, "data.path", "is a directory; source 'text' reads one UTF-8 text file"),
    (lambda d: (d / "short.txt").write_text("twelve bytes") and d / "short.txt", "data.path",
     "has 12 bytes, fewer than one window of data.seq_len + 1 = 17"),
    (lambda d: (d / "bin.txt").write_bytes(b"\xff\xfe" * 40) and d / "bin.txt", "data.path", "not UTF-8 text"),
    (lambda d: _sparse(d / "big.txt", MAX_TEXT_BYTES + 1), "data.path",
     "holds 256 MiB, more than source 'text' takes (256 MiB: every rank holds it whole); prepare it"),
])
def test_a_text_source_that_cannot_train_is_refused_before_any_rank_starts(tmp_path, make, field, words):
    data = {"source": "text", "seq_len": 16, "path": str(make(tmp_path))}
    [problem] = data_problems(spec(tmp_path, data=data))
    assert problem.field == field and words in problem.message, problem


def test_a_text_source_not_utf8_or_of_unknown_size_past_the_limit_is_refused_with_its_own_fix(tmp_path, monkeypatch):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe" * 40)
    [problem] = data_problems(spec(tmp_path, data={"source": "text", "seq_len": 16, "path": str(tmp_path / "bin.txt")}))
    assert "is not UTF-8 text (" in problem.message and "give a text file" in problem.message
    assert "storage_options" not in problem.message  # the store is not what is wrong
    import fsspec

    import trainer.data

    # A store that tells no size (an HTTP server without Content-Length): the limit holds on what is read.
    monkeypatch.setattr(trainer.data, "MAX_TEXT_BYTES", 1000)
    monkeypatch.setattr(type(fsspec.filesystem("file")), "size", lambda self, path: None)
    (tmp_path / "big.txt").write_text("x" * 5000)
    with pytest.raises(trainer.data.TextTooLarge, match="holds over .* MiB, more than source .text. takes"):
        trainer.data.read_text_bytes(str(tmp_path / "big.txt"))
    # A streamed file's read(n) gives what has arrived so far: the file is read to its end all the same.
    local = type(fsspec.filesystem("file"))
    opened = local.open

    def streamed(self, path, mode="rb", **kwargs):
        handle = opened(self, path, mode, **kwargs)
        whole = handle.read
        handle.read = lambda n=-1: whole(min(n, 7) if n is not None and n >= 0 else 7)
        return handle

    monkeypatch.setattr(local, "open", streamed)
    (tmp_path / "small.txt").write_text("a line of text, read seven bytes at a time\n")
    assert bytes(trainer.data.read_text_bytes(str(tmp_path / "small.txt")).tolist()) == \
        (tmp_path / "small.txt").read_bytes()


def test_a_readable_text_source_passes(tmp_path):
    (tmp_path / "ok.txt").write_text("a long enough line of text for one window\n" * 3)
    assert data_problems(spec(tmp_path, data={"source": "text", "seq_len": 16, "path": str(tmp_path / "ok.txt")})) == []


def test_pipeline_validation_windows_must_fit_the_stages(tmp_path):
    with pytest.raises(SpecError) as err:
        spec(tmp_path, data={"seq_len": 16}, parallel={"pp": 2},
             train={"steps": 10, "global_batch": 4}, eval={"path": "x", "every_steps": 5, "seq_len": 32})
    assert any(p.field == "eval.seq_len" and "static shape" in p.message for p in err.value.problems)


def test_the_hang_limit_allows_for_a_validation_where_one_is_due(tmp_path):
    job = spec(tmp_path, eval={"path": "x", "every_steps": 5, "windows": 40})
    assert hang_limit(1.0, 4, job, 10.0, 5.0) == 10.0  # no validation after step 4
    # after step 5: 10 global batches of windows, each at most a step: 5 x 10 steps more, plus start-up
    assert hang_limit(1.0, 5, job, 10.0, 5.0) == 10.0 + 10.0 + 5.0 * 10
    assert hang_limit(1.0, 10, job, 10.0, 5.0) > 10.0  # the last step
    assert hang_limit(1.0, 5, spec(tmp_path), 10.0, 5.0) == 10.0  # no eval section


def test_a_dataset_with_a_shard_missing_or_cut_short_is_refused_before_any_rank_starts(tmp_path):
    write_token_dataset(tmp_path / "d", TOKENS, 256, shard_tokens=1000)
    data = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "d")}
    assert data_problems(spec(tmp_path, data=data)) == []
    shards = sorted((tmp_path / "d").glob("*.tokens"))
    shards[1].write_bytes(shards[1].read_bytes()[:-2])  # a copy cut short
    shards[3].unlink()
    [problem] = data_problems(spec(tmp_path, data=data))
    assert problem.field == "data.path" and "is damaged" in problem.message and "prepare it again" in problem.message
    assert f"{shards[1].name} is 1998 bytes where the manifest says 2000" in problem.message
    assert f"{shards[3].name} is missing" in problem.message


def test_shards_are_sized_one_by_one_when_the_listing_is_denied_or_has_no_sizes(tmp_path, monkeypatch):
    from trainer.tokens.reader import TokenDataset

    write_token_dataset(tmp_path / "d", TOKENS, 256, shard_tokens=1000)
    ds = TokenDataset(str(tmp_path / "d"))
    shards = sorted((tmp_path / "d").glob("*.tokens"))
    shards[0].write_bytes(shards[0].read_bytes()[:-2])
    monkeypatch.setattr(ds.fs, "ls", lambda path, detail=True: [{"name": f"{path}/{p.name}", "size": None}
                                                                 for p in (tmp_path / "d").iterdir()])
    assert ds.damaged_shards() == [f"{shards[0].name} is 1998 bytes where the manifest says 2000"]

    def denied(path, detail=True):
        raise PermissionError("s3:ListBucket denied")

    monkeypatch.setattr(ds.fs, "ls", denied)
    shards[1].unlink()
    assert ds.damaged_shards() == [f"{shards[0].name} is 1998 bytes where the manifest says 2000",
                                   f"{shards[1].name} is missing"]
    data = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "d")}
    problems = data_problems(spec(tmp_path, data=data, eval={"path": str(tmp_path / "d"), "every_steps": 5}))
    assert {p.field for p in problems} == {"data.path", "eval.path"}  # the validation set is checked too


def test_a_store_that_refuses_the_options_is_a_problem_naming_them_not_a_traceback(tmp_path):
    # s3fs hands a misspelt option to botocore, which refuses it (a TypeError) at the first call.
    data = {"source": "tokens", "seq_len": 16, "path": "s3://bucket/ds",
            "storage_options": {"endpointurl": "http://127.0.0.1:9"}}
    [problem] = data_problems(spec(tmp_path, data=data))
    assert problem.field == "data.path"
    assert "data.storage_options: 'endpointurl' is not an option this store takes" in problem.message


def test_pretrained_weights_are_checked_against_the_model_before_any_rank_starts(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from tests._hf import save_hf

    save_hf(tmp_path / "hf")
    job = spec(tmp_path, model={"from_hf": str(tmp_path / "hf")}, data={"source": "synthetic"})
    assert data_problems(job) == []
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    [problem] = data_problems(job)
    assert problem.field == "model.from_hf" and "no tensor model.layers.1.mlp.up_proj.weight" in problem.message
    weights.rename(tmp_path / "hf" / "pytorch_model.bin")
    [problem] = data_problems(job)
    assert problem.field == "model.from_hf" and "neither model.safetensors nor" in problem.message


def test_a_dataset_smaller_than_its_share_of_one_step_is_refused_not_read_twice_in_a_step(tmp_path):
    write_token_dataset(tmp_path / "a", TOKENS, 256)  # 5000 tokens: 294 windows of 17
    write_token_dataset(tmp_path / "b", TOKENS[:1700], 256)  # 100 windows
    data = {"source": "tokens", "seq_len": 16, "path": str(tmp_path / "a")}
    assert data_problems(spec(tmp_path, data=data, train={"steps": 10, "global_batch": 294})) == []
    [problem] = data_problems(spec(tmp_path, data=data, train={"steps": 10, "global_batch": 296}))
    assert problem.field == "data.path" and "294 windows" in problem.message
    assert "fewer than the train.global_batch = 296 samples a step draws" in problem.message
    mixture = {"source": "tokens", "seq_len": 16, "mixture": [{"path": str(tmp_path / "a"), "weight": 1},
                                                              {"path": str(tmp_path / "b"), "weight": 1}]}
    assert data_problems(spec(tmp_path, data=mixture, train={"steps": 10, "global_batch": 200})) == []
    [problem] = data_problems(spec(tmp_path, data=mixture, train={"steps": 10, "global_batch": 202}))
    assert problem.field == "data.mixture[1].path" and "101 samples a step draws" in problem.message
    assert "raise the weight of the other datasets" in problem.message


def test_a_mixture_weight_that_would_never_be_drawn_or_overflows_is_refused():
    base = {"name": "j", "model": {"preset": "tiny"}, "train": {"steps": 10, "global_batch": 4},
            "checkpoint": {"url": "file:///tmp/ck"}}

    def mixture(*weights):
        return {**base, "data": {"source": "tokens", "seq_len": 16,
                                 "mixture": [{"path": f"/d{i}", "weight": w} for i, w in enumerate(weights)]}}

    assert validate_spec(mixture(1, 0.03)).data.mixture[1].weight == 0.03  # about one of the 40 samples
    for weights, field in (((1, 1e-17), "data.mixture[1].weight"), ((1e308, 1e308), "data.mixture")):
        with pytest.raises(SpecError) as err:
            validate_spec(mixture(*weights))
        assert [p.field for p in err.value.problems] == [field]


def test_a_dataset_that_holds_its_share_but_not_what_the_dealing_gives_it_in_some_step_is_refused(tmp_path):
    # Weights 1:2:3 over a batch of 4: the third dataset's share is 2 samples a step, yet the dealing (to
    # within one sample per dataset listed before it) gives it 3 in some steps; 2 windows cannot hold 3.
    write_token_dataset(tmp_path / "a", TOKENS, 256)
    write_token_dataset(tmp_path / "b", TOKENS, 256)
    write_token_dataset(tmp_path / "c", TOKENS[:34], 256)  # 2 windows of 17
    mixture = {"source": "tokens", "seq_len": 16, "mixture": [
        {"path": str(tmp_path / "a"), "weight": 1}, {"path": str(tmp_path / "b"), "weight": 2},
        {"path": str(tmp_path / "c"), "weight": 3}]}
    [problem] = data_problems(spec(tmp_path, data=mixture, train={"steps": 10, "global_batch": 4}))
    assert problem.field == "data.mixture[2].path" and "the 3 samples step" in problem.message
    assert "that step would read some windows twice" in problem.message
    write_token_dataset(tmp_path / "c3", TOKENS[:51], 256)  # 3 windows: enough for every step
    mixture["mixture"][2]["path"] = str(tmp_path / "c3")
    assert data_problems(spec(tmp_path, data=mixture, train={"steps": 10, "global_batch": 4})) == []
