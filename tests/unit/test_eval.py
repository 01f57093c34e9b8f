"""Validation loss: `undying eval` of a checkpoint equals the Hugging Face model's own loss on the
same windows, the engine's distributed evaluation equals the one-process number, and the
semantics (first K non-overlapping windows of T+1 tokens) hold exactly."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from orchestrator.cli.main import main  # noqa: E402
from tests._hf import commit, engine_from_hf, save_hf  # noqa: E402
from tests._tokens import write_token_dataset  # noqa: E402
from trainer.evaluation import eval_windows, loss_of_model, padded_microbatches, shard_windows  # noqa: E402
from trainer.tokens.reader import TokenDataset  # noqa: E402

K, T = 12, 31


@pytest.fixture
def dataset(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 96, size=2000)
    return write_token_dataset(tmp_path / "val", tokens, vocab_size=96, shard_tokens=300)


def hf_loss(hf, windows) -> float:
    total, tokens = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = hf(w[:-1].unsqueeze(0)).logits[0]
            total += float(F.cross_entropy(logits.double(), w[1:], reduction="sum"))
            tokens += T
    return total / tokens


def test_windows_are_the_first_k_of_t_plus_1_tokens_across_shards(dataset):
    ds = TokenDataset(str(dataset))
    windows = eval_windows(ds, T, K)
    assert len(windows) == K and all(w.numel() == T + 1 for w in windows)
    assert torch.equal(torch.cat(windows), torch.from_numpy(ds.read(0, K * (T + 1))))
    with pytest.raises(ValueError, match="fewer than the 100 asked"):
        eval_windows(ds, T, 100)


def test_undying_eval_equals_the_hf_models_loss_on_the_same_windows(tmp_path, dataset, capsys):
    hf = save_hf(tmp_path / "hf")
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    assert main(["eval", f"file://{tmp_path}/ck", "--data", str(dataset), "--windows", str(K),
                 "--seq-len", str(T), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["step"], out["tokens"], out["windows"], out["seq_len"]) == (0, K * T, K, T)
    expected = hf_loss(hf, eval_windows(TokenDataset(str(dataset)), T, K))
    assert out["loss"] == pytest.approx(expected, rel=1e-5)
    # default T: the sequence length the job trained with (16 here, recorded in the manifest)
    assert main(["eval", f"file://{tmp_path}/ck", "--data", str(dataset), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 16


def test_eval_refuses_what_cannot_work_by_argument(tmp_path, dataset, capsys):
    save_hf(tmp_path / "hf")
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    url = f"file://{tmp_path}/ck"
    assert main(["eval", url, "--data", str(dataset), "--windows", "500", "--seq-len", str(T)]) == 2
    assert "--windows 500" in capsys.readouterr().err
    assert main(["eval", url, "--data", str(tmp_path / "nothing")]) == 2
    assert "run `undying data prepare` first" in capsys.readouterr().err
    (tmp_path / "corpus.txt").write_text("text, not a prepared dataset")
    for data, words in ((str(tmp_path / "corpus.txt"), "corpus.txt: a file, not a prepared dataset; prepare it first"),
                        ("htps://host/data", "--data htps://host/data: unknown or unavailable protocol"),
                        ("s3:/bucket/data", "--data 's3:/bucket/data' has one slash after 's3:'"),
                        ("s3:bucket/data", "did you mean 's3://bucket/data'?")):
        assert main(["eval", url, "--data", data]) == 2
        assert words in capsys.readouterr().err
    wide = write_token_dataset(tmp_path / "wide", np.arange(3000) % 500, vocab_size=500)
    assert main(["eval", url, "--data", str(wide), "--seq-len", str(T)]) == 2
    assert "beyond the model's vocabulary of 96" in capsys.readouterr().err
    for argv, words in ((["--device", "bogus"], "--device 'bogus': not a torch device"),
                        (["--device", "cuda"], "no CUDA device"), (["--seq-len", "-5"], "--seq-len -5: must be"),
                        (["--seq-len", "0"], "--seq-len 0: must be"),
                        (["--device", "cuda:7"], "cuda:7"),
                        (["--read-retry-s", "-1"], "--read-retry-s -1: must be 0 (no retry)")):
        if argv[-1].startswith("cuda") and torch.cuda.device_count() > int(argv[-1].partition(":")[2] or 0):
            continue
        assert main(["eval", url, "--data", str(dataset), "--json", *argv]) == 2
        out = json.loads(capsys.readouterr().out)
        assert words in out["error"], out


def test_arguments_and_the_manifest_are_checked_before_the_weights_are_read(tmp_path, dataset, capsys, monkeypatch):
    import ckpt.reader

    save_hf(tmp_path / "hf")
    catalog = commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    url, step = f"file://{tmp_path}/ck", catalog.latest()
    monkeypatch.setattr(ckpt.reader, "load_checkpoint", lambda *a, **k: pytest.fail("the weights were read"))
    assert main(["eval", url, "--data", str(dataset), "--windows", "500", "--seq-len", str(T)]) == 2
    assert "--windows 500" in capsys.readouterr().err
    doc = json.loads(catalog.storage.read(catalog.manifest_path(step)))
    (tmp_path / "ck" / f"step-{step:09d}" / "manifest.json").write_text(json.dumps({**doc, "schema_version": 99}))
    assert main(["eval", url, "--data", str(dataset)]) == 2  # a newer undying's checkpoint: one line, no traceback
    err = capsys.readouterr().err
    assert f"--step {step}:" in err and "schema_version 99" in err and "Traceback" not in err


def test_data_tokenized_otherwise_than_the_job_s_is_refused(tmp_path, dataset, capsys):
    save_hf(tmp_path / "hf")
    recorded = {"url": "file:///tok/tokenizer.json", "sha256": "a" * 64}  # what a job on prepared data records
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck", tokenizer=recorded)
    assert main(["eval", f"file://{tmp_path}/ck", "--data", str(dataset), "--seq-len", str(T)]) == 2
    err = capsys.readouterr().err
    assert "tokenized with another tokenizer" in err and "file:///tok/tokenizer.json" in err


def test_a_checkpoint_trained_on_bytes_is_not_evaluated_on_a_tokenizers_ids(tmp_path, dataset, capsys):
    save_hf(tmp_path / "hf")
    catalog = commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    step = catalog.latest()
    doc = json.loads(catalog.storage.read(catalog.manifest_path(step)))
    doc["state"]["engine"]["data"] = {"source": "text", "seq_len": T, "bytes": 4000, "crc32": 7}  # a text job's
    (tmp_path / "ck" / f"step-{step:09d}" / "manifest.json").write_text(json.dumps(doc))
    assert main(["eval", f"file://{tmp_path}/ck", "--data", str(dataset), "--seq-len", str(T)]) == 2
    err = capsys.readouterr().err
    assert "trained on data.source 'text'" in err and "Traceback" not in err


def test_the_engines_evaluation_equals_the_one_process_loss(tmp_path, dataset):
    save_hf(tmp_path / "hf")
    engine = engine_from_hf(tmp_path / "hf")
    windows = eval_windows(TokenDataset(str(dataset)), T, K)
    total, tokens = engine.evaluate(windows)
    assert tokens == K * T
    assert total / tokens == pytest.approx(loss_of_model(engine.model, windows).loss, rel=1e-6)


def test_shares_and_padding_give_every_rank_the_same_microbatches():
    windows = [torch.arange(5) + i for i in range(7)]
    shares = [shard_windows(windows, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [3, 2, 2] and sum(shares, []) == windows
    batches = padded_microbatches(shares[1], micro_batch=2, count=2, seq_len=4)
    assert len(batches) == 2 and [b.n_tokens for b in batches] == [8, 0]
