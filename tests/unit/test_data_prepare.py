"""`undying data prepare` end to end through the CLI, with the units run in this process
instead of on Ray Data (`execute.run_serial`; the Ray run is tests/ray/test_data_prepare.py):
the token stream against a one-document-at-a-time reference, "already prepared", the
refusals, resuming an interrupted run, and every user mistake as one line and exit 2."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from orchestrator.cli.data import execute
from orchestrator.cli.main import main
from tests._corpus import documents, expected_stream, train_tokenizer, write_corpus
from trainer.tokens import TokenDataset


class Recorder:
    """An executor that runs units in-process and records them; `stop_after` interrupts it."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.results = []
        self.stop_after = stop_after

    def __call__(self, job, indices, sink) -> None:
        recorder = self

        class Recording:
            def started(self, where: str) -> None:
                sink.started(where)

            def result(self, result) -> bool:
                recorder.results.append(result)
                if recorder.stop_after is not None and len(recorder.results) >= recorder.stop_after:
                    raise KeyboardInterrupt  # the run dies here, as under Ctrl-C or a lost driver
                return sink.result(result)

        execute.run_serial(job, indices, Recording())


@pytest.fixture
def executor(monkeypatch):
    """Replaces Ray Data: the next `undying data prepare` runs its units with this recorder."""
    box = {"executor": Recorder()}
    monkeypatch.setattr(execute, "RayDataExecutor", lambda address: box["executor"])
    return box


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(120)
    tokenizer = train_tokenizer(root / "tokenizer.json", docs)
    inputs = write_corpus(root / "in", docs, hf=True)
    return root, tokenizer, inputs, docs


def prepare(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["data", "prepare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def args_for(corpus, out: Path, *extra: str) -> list[str]:
    _, tokenizer, inputs, _ = corpus
    return [*(str(p) for p, _ in inputs), "--tokenizer", str(tokenizer), "--out", str(out), "--shard-tokens", "60",
            *extra]


def check_stream(out: Path, tokenizer: Path, docs: list[str]) -> TokenDataset:
    tokens, ends = expected_stream(tokenizer, docs)
    ds = TokenDataset(str(out))
    assert ds.n_tokens == len(tokens) and ds.n_documents == len(ends) == len([d for d in docs if d])
    assert np.array_equal(ds.read(0, ds.n_tokens), tokens)
    assert np.array_equal(ds.document_bounds(), ends)
    return ds


def test_prepare_matches_one_process_tokenization(capsys, executor, corpus, tmp_path):
    root, tokenizer, inputs, docs = corpus
    code, out, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 0, err
    assert "prepared file://" in out and f"{len([d for d in docs if d])} documents" in out  # "" is no document
    assert "" in docs
    ds = check_stream(tmp_path / "out", tokenizer, docs)
    m = ds.manifest
    assert len(m.shards) >= 5 and m.dtype == "uint16" and m.text_field == "text"
    assert m.inputs == [f"file://{p}" for p, _ in inputs]
    assert m.tokenizer_sha256 == hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    assert m.eos_id == Tokenizer.from_file(str(tokenizer)).token_to_id("</s>")
    assert not any(r.reused for r in executor["executor"].results)


def test_rerun_is_already_prepared_and_other_inputs_are_refused(capsys, executor, corpus, tmp_path):
    root, tokenizer, inputs, docs = corpus
    assert prepare(capsys, *args_for(corpus, tmp_path / "out"))[0] == 0
    executor["executor"] = Recorder()
    code, out, _ = prepare(capsys, *args_for(corpus, tmp_path / "out", "--shard-tokens", "1000"))
    assert code == 0 and out.startswith(f"already prepared: file://{tmp_path}/out (")
    assert not executor["executor"].results
    shard = sorted((tmp_path / "out").glob("*.tokens"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])  # cut short after the commit: the job would refuse it
    code, out, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 2 and "already prepared" not in out and f"{shard.name} is" in err and "damaged" in err

    code, _, err = prepare(capsys, str(inputs[0][0]), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 2 and err.count("\n") == 1
    assert "already holds a dataset prepared from other inputs" in err and "choose another --out" in err

    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out", "--eos-token", "<unk>"))
    assert code == 2 and "prepared from another end-of-document token (id 1, not 0)" in err

    other = train_tokenizer(tmp_path / "other.json", docs, vocab_size=300)
    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out")[:-6], "--tokenizer", str(other),
                           "--out", str(tmp_path / "out"))
    assert code == 2 and "prepared from another tokenizer" in err


def test_a_changed_input_is_refused(capsys, executor, corpus, tmp_path):
    root, tokenizer, inputs, docs = corpus
    txt = tmp_path / "one.txt"
    txt.write_text("first version")
    base = [str(txt), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")]
    assert prepare(capsys, *base)[0] == 0
    txt.write_text("second version, longer")
    code, _, err = prepare(capsys, *base)
    assert code == 2 and "another version of input" in err


def test_an_interrupted_run_resumes_and_writes_the_same_bytes(capsys, executor, corpus, tmp_path):
    root, tokenizer, inputs, docs = corpus
    assert prepare(capsys, *args_for(corpus, tmp_path / "ref"))[0] == 0
    reference = (tmp_path / "ref" / "manifest.json").read_bytes()

    executor["executor"] = Recorder(stop_after=3)
    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 130 and err.splitlines()[-1].endswith(": interrupted")  # one line, no traceback
    assert not (tmp_path / "out" / "manifest.json").exists() and (tmp_path / "out" / "plan.json").exists()
    # One finished shard is damaged afterwards: a resume must redo it, not trust its marker.
    shard = tmp_path / "out" / "shard-000001.tokens"
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])

    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out", "--shard-tokens", "61"))
    assert code == 2 and "unfinished preparation of another --shard-tokens (60, not 61)" in err

    executor["executor"] = Recorder()
    code, out, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 0, err
    assert "resuming the unfinished preparation" in out and "(2 kept from an earlier run)" in err
    reused = sorted(r.index for r in executor["executor"].results if r.reused)
    assert reused == [0, 2]
    assert (tmp_path / "out" / "manifest.json").read_bytes() == reference
    check_stream(tmp_path / "out", tokenizer, docs)


def test_a_plan_written_before_empty_texts_were_skipped_resumes_under_its_own_rule(capsys, executor, corpus,
                                                                                   tmp_path, monkeypatch):
    # One dataset must not mix the rules: the release before made an empty record EOS alone, and the
    # shards its interrupted run finished are kept (the plan's bytes and hash as that release wrote them).
    from orchestrator.cli.data import plan as plan_module
    from orchestrator.cli.data import prepare as prepare_module

    _, tokenizer, _, _ = corpus
    texts = ["a b " * 30, "", "c d " * 30, "", "e f " * 30]  # an empty record in each of the units
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    argv = [str(tmp_path / "docs.jsonl"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"),
            "--shard-tokens", "20"]
    made = plan_module.make_plan

    def as_before(*args, **kwargs):  # the release before: no skip_empty_texts in its plan
        return made(*args, **kwargs).model_copy(update={"skip_empty_texts": False})

    monkeypatch.setattr(prepare_module, "make_plan", as_before)
    executor["executor"] = Recorder(stop_after=1)
    assert prepare(capsys, *argv)[0] == 130
    assert "skip_empty_texts" not in json.loads((tmp_path / "out" / "plan.json").read_text())
    monkeypatch.setattr(prepare_module, "make_plan", made)  # this release resumes it
    executor["executor"] = Recorder()
    code, out, err = prepare(capsys, *argv)
    assert code == 0 and "resuming the unfinished preparation" in out and "(1 kept from an earlier run)" in err, err
    assert TokenDataset(str(tmp_path / "out")).n_documents == 5  # "" EOS alone throughout, as the plan says
    fresh = [*argv[:4], str(tmp_path / "new"), *argv[5:]]
    assert prepare(capsys, *fresh)[0] == 0 and TokenDataset(str(tmp_path / "new")).n_documents == 3


def test_a_location_that_holds_something_else_is_refused(capsys, executor, corpus, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 2 and "is not empty (notes.txt) and holds no plan.json" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt"]


def test_a_bad_record_in_a_task_fails_with_one_line_and_no_manifest(capsys, executor, corpus, tmp_path):
    root, tokenizer, _, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    code, _, err = prepare(capsys, str(bad), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 2 and "Traceback" not in err
    # After the progress lines, the error: one line, and what to do.
    assert err.splitlines()[-2].startswith(f"undying data prepare: INPUT {bad}: the line at byte 17 is not valid UTF-8")
    assert "nothing of this run was kept" in err.splitlines()[-1] and "same command again" in err.splitlines()[-1]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["withdrawn.json"]
    (tmp_path / "out" / "shard-000000.tokens").write_bytes(b"late")  # a task elsewhere wrote after the failure
    bad.write_bytes(b'{"text": "fine"}\n{"text": "cafe"}\n')  # fixed: the same command now prepares it
    (tmp_path / "out" / "notes.txt").write_text("mine")  # ...but not over a file of the user's
    code, _, err = prepare(capsys, str(bad), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 2 and "is not empty" in err and (tmp_path / "out" / "notes.txt").exists()
    (tmp_path / "out" / "notes.txt").unlink()
    code, out, _ = prepare(capsys, str(bad), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 0 and "prepared" in out and (tmp_path / "out" / "manifest.json").exists()


def test_user_mistakes_are_one_line_naming_the_argument(capsys, executor, corpus, tmp_path):
    root, tokenizer, inputs, _ = corpus
    jsonl = tmp_path / "other.jsonl"
    jsonl.write_text(json.dumps({"body": "x"}) + "\n")
    (tmp_path / "data.csv").write_text("a,b\n")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    no_eos = tmp_path / "no_eos.json"
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(no_eos))
    capsys.readouterr()  # datasets' own progress bars
    out = ["--out", str(tmp_path / "out")]
    tok = ["--tokenizer", str(tokenizer)]
    parquet = str(inputs[3][0])
    alias = tmp_path / "alias.parquet"  # the same file by another name
    alias.symlink_to(parquet)
    cases = [
        ([str(tmp_path / "missing.txt"), *tok], "INPUT", "no such file or directory"),
        ([str(tmp_path / "data.csv"), *tok], "INPUT", "unsupported extension '.csv'"),
        ([str(jsonl), *tok], "--text-field text", "has no field 'text' (it has 'body')"),
        ([parquet, *tok, "--text-field", "body"], "--text-field body", "the schema of"),
        ([parquet, *tok, "--text-field", "n"], "--text-field n", "holds int64, not strings"),
        ([str(tmp_path / "dd"), *tok], "INPUT", "a DatasetDict; give one split's directory, e.g."),
        ([parquet, "--tokenizer", str(tmp_path / "none.json")], "--tokenizer", "no such file or directory"),
        ([parquet, "--tokenizer", str(no_eos)], "--eos-token", "pass --eos-token"),
        ([parquet, *tok, "--storage-option", "oops"], "--storage-option", "expects KEY=VALUE"),
        ([parquet, *tok, "--shard-tokens", "0"], "--shard-tokens 0", "must be at least 1"),
        ([parquet, parquet, *tok], f"INPUT {parquet} reads", f"which INPUT {parquet} reads too"),
        ([parquet, str(alias), *tok], f"INPUT {alias} reads", "would be in the dataset twice"),
    ]
    for argv, argument, message in cases:
        code, _, err = prepare(capsys, *argv, *out)
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"undying data prepare: {argument}") and message in err, err
    assert not (tmp_path / "out").exists() and not executor["executor"].results
    for where, message in (("", "is empty"), ("file:/tmp/x", "did you mean 'file:///tmp/x'?")):
        code, _, err = prepare(capsys, parquet, *tok, "--out", where)
        assert code == 2 and err.startswith(f"undying data prepare: --out {where!r}: ") and message in err, err
    hf_dir = str(inputs[-1][0])  # a datasets save_to_disk directory: the dataset must not land in it
    (tmp_path / "linked").symlink_to(hf_dir)
    for into, what in ((parquet, "is INPUT 2"), (f"{hf_dir}/tokens", "is inside INPUT 1"),
                       (str(tmp_path / "linked" / "tokens"), "is inside INPUT 1")):
        code, _, err = prepare(capsys, hf_dir, parquet, *tok, "--out", into)
        assert code == 2 and what in err and "give a new directory for the dataset" in err, err


def test_inputs_without_a_document_commit_nothing_and_exit_2(capsys, executor, corpus, tmp_path):
    _, tokenizer, _, _ = corpus
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n\n" + json.dumps({"text": ""}) + "\n")
    code, _, err = prepare(capsys, str(blank), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out"))
    assert code == 2 and "hold no document (every record empty, or none at all)" in err, err
    assert not (tmp_path / "out" / "manifest.json").exists() and "Traceback" not in err


def test_large_vocabularies_store_uint32_ids(capsys, executor, tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "big.json"))
    docs = ["w69999 w3 w65534", "w65535 w65536", ""]
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps({"content": d}) + "\n" for d in docs)
    code, _, err = prepare(capsys, str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "big.json"),
                           "--text-field", "content", "--out", str(tmp_path / "out"))
    assert code == 0, err
    ds = check_stream(tmp_path / "out", tmp_path / "big.json", docs)
    assert ds.manifest.dtype == "uint32" and ds.read(0, 3).tolist() == [70_001, 5, 65_536]


def test_a_resume_may_spell_the_inputs_and_tokenizer_differently(capsys, executor, corpus, tmp_path, monkeypatch):
    root, tokenizer, inputs, docs = corpus
    executor["executor"] = Recorder(stop_after=2)
    assert prepare(capsys, *args_for(corpus, tmp_path / "out"))[0] == 130
    monkeypatch.chdir(root)
    relative = [str(p.relative_to(root)) for p, _ in inputs]
    executor["executor"] = Recorder()
    code, out, err = prepare(capsys, *relative, "--tokenizer", f"file://{tokenizer}", "--out", str(tmp_path / "out"),
                             "--shard-tokens", "60")
    assert code == 0 and "resuming" in out, err
    check_stream(tmp_path / "out", tokenizer, docs)


def test_a_tokenizer_saved_to_truncate_or_pad_still_gives_whole_documents_and_text_stays_text(
        capsys, executor, corpus, tmp_path):
    # A tokenizer.json saved for inference (truncation at its context, padding to the batch's
    # longest) must not cut or pad a training stream; a literal "</s>" in a document is text, not
    # a document boundary of its own.
    _, tokenizer, _, docs = corpus
    saved = Tokenizer.from_file(str(tokenizer))
    saved.enable_truncation(4)
    saved.enable_padding(pad_id=saved.token_to_id("</s>"), pad_token="</s>")
    inference = tmp_path / "inference.json"
    saved.save(str(inference))
    texts = [*filter(None, docs[:6]), "a sentence that quotes </s> inside it", "short"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    code, _, err = prepare(capsys, str(tmp_path / "docs.jsonl"), "--tokenizer", str(inference), "--out",
                           str(tmp_path / "out"))
    assert code == 0, err
    reference = Tokenizer.from_file(str(tokenizer))
    reference.encode_special_tokens = True
    eos = reference.token_to_id("</s>")
    expected = [i for t in texts for i in [*reference.encode(t, add_special_tokens=False).ids, eos]]
    ds = TokenDataset(str(tmp_path / "out"))
    assert ds.read(0, ds.n_tokens).tolist() == expected and ds.n_documents == len(texts)
    assert np.count_nonzero(ds.read(0, ds.n_tokens) == eos) == len(texts)  # only the documents' ends


def test_a_parquet_column_that_is_not_utf8_is_one_line_and_the_fixed_file_prepares(capsys, executor, corpus,
                                                                                    tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, tokenizer, _, _ = corpus
    raw = pa.array([b"fine", b"caf\xe9"], type=pa.binary())
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())}), bad)
    args = [str(bad), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")]
    code, _, err = prepare(capsys, *args)
    assert code == 2 and "Traceback" not in err
    assert f"INPUT {bad}: row group 0 (from row 0) holds text that is not valid UTF-8 (byte 0xe9)" in err
    pq.write_table(pa.table({"text": ["fine", "cafe"]}), bad)  # fixed: the same command prepares it
    code, out, err = prepare(capsys, *args)
    assert code == 0 and "prepared" in out, err


def test_a_task_that_keeps_dying_fails_the_run_in_one_line_and_the_rerun_resumes(capsys, executor, corpus,
                                                                                  tmp_path):
    from orchestrator.cli.data.shard_task import UnitResult

    def dying(job, indices, sink):  # what RayDataExecutor reports once a unit's retries are spent
        sink.started("a cluster")
        sink.result(UnitResult(-1, error=execute.task_failure(RuntimeError("OutOfMemoryError: worker killed")),
                               error_kind="task"))

    executor["executor"] = dying
    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("undying data prepare: a unit's task failed 4 times (RuntimeError: ")
    assert "give the workers more memory" in err and (tmp_path / "out" / "plan.json").exists()  # kept: resumable
    executor["executor"] = Recorder()
    code, out, _ = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 0 and "resuming the unfinished preparation" in out


def test_a_reader_s_own_error_in_a_task_is_one_line_naming_the_input_not_a_dying_worker(capsys, executor, corpus,
                                                                                       tmp_path, monkeypatch):
    """An exception of the input's reader (pyarrow on a damaged parquet, a tokenizer's) is the task's
    answer, not a raise that Ray Data would retry as a dead worker and report as out of memory."""
    from orchestrator.cli.data import shard_task

    def broken(job, unit):
        raise RuntimeError("ArrowInvalid: Parquet magic bytes not found in footer")

    real = shard_task.tokenize_unit
    monkeypatch.setattr(shard_task, "tokenize_unit", broken)
    code, _, err = prepare(capsys, *args_for(corpus, tmp_path / "out"))
    assert code == 2 and "Traceback" not in err and "worker died" not in err
    assert "Parquet magic bytes not found" in err and "file://" in err and "fix that input" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["withdrawn.json"]  # so the next run starts clean
    monkeypatch.setattr(shard_task, "tokenize_unit", real)  # the input fixed
    assert prepare(capsys, *args_for(corpus, tmp_path / "out"))[0] == 0


def test_a_jsonl_input_whose_store_reports_no_size_is_refused_naming_it(monkeypatch, tmp_path):
    # fsspec's HTTP files without a Content-Length: cut by byte range up to size 0, its records were
    # silently left out. Any store that answers so is refused with the fix.
    import fsspec

    from orchestrator.cli.data.sources import resolve_sources
    from orchestrator.cli.exits import UsageError

    jsonl = tmp_path / "served.jsonl"
    jsonl.write_text(json.dumps({"text": "a"}) + "\n")
    local = type(fsspec.filesystem("file"))
    info = local.info
    monkeypatch.setattr(local, "info", lambda self, path, **kw: {**info(self, path, **kw), "size": None})
    with pytest.raises(UsageError, match=f"INPUT {jsonl}: the store reports no size for it") as err:
        resolve_sources([str(jsonl)], "text", {})
    assert "copy it to a local directory or to s3://" in str(err.value)


def test_the_warm_ups_share_one_copy_of_the_tokenizer_in_the_object_store(monkeypatch):
    import types

    import ray

    puts, calls = [], []
    monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or f"ref{len(puts)}")
    remote = types.SimpleNamespace(remote=lambda *args: calls.append(args))
    monkeypatch.setattr(ray, "remote", lambda **options: lambda fn: remote)
    job = types.SimpleNamespace(tokenizer_json="{...}", plan=types.SimpleNamespace(tokenizer_sha256="s",
                                                                                  parse_special_tokens=False))
    execute.warm_workers(job, 4)
    assert puts == ["{...}"] and [args[0] for args in calls] == ["ref1"] * 4
