"""Hugging Face weights in and out: a Llama saved by transformers loads into the engine exactly,
and a checkpoint exports as a directory transformers loads with no missing or unexpected key."""

import json
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from ckpt.hf_export import export_hf  # noqa: E402
from ckpt.safetensors_source import BadSafetensors, parse_header  # noqa: E402
from orchestrator.cli.main import main  # noqa: E402
from tests._hf import commit, engine_from_hf, logits, save_hf  # noqa: E402
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from trainer.engine import Engine  # noqa: E402

IDS = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tie, shard", [(False, None), (True, "20KB")])
def test_hf_weights_load_exactly_from_one_file_or_an_index(tmp_path, tie, shard):
    hf = save_hf(tmp_path / "hf", tie=tie, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shard)
    engine = engine_from_hf(tmp_path / "hf")
    torch.testing.assert_close(logits(engine.model, IDS), logits(hf, IDS), rtol=0, atol=1e-5)


def test_a_header_read_the_store_fails_once_is_read_again_within_the_budget(tmp_path, monkeypatch):
    from ckpt.errors import TransientStorageError
    from ckpt.hf_import import read_hf_slices
    from ckpt.storage import Storage
    from ckpt.storage_errors import ReadRetry

    save_hf(tmp_path / "hf")
    cfg = ModelConfig(from_hf=str(tmp_path / "hf"))
    wanted = [s for s in engine_from_hf(tmp_path / "hf").wanted_slices() if s.name.startswith("model/")]
    read_range, failures = Storage.read_range, []

    def flaky(self, path, start, end):  # a header's first ranged read meets a throttled store
        if start == 0 and not failures:
            failures.append(path)
            raise ConnectionResetError("connection reset by peer")
        return read_range(self, path, start, end)

    monkeypatch.setattr(Storage, "read_range", flaky)
    with pytest.raises(TransientStorageError, match="the safetensors headers"):
        read_hf_slices(str(tmp_path / "hf"), wanted, cfg, retry=ReadRetry(0.0))  # no budget: given up, named
    failures.clear()
    assert len(read_hf_slices(str(tmp_path / "hf"), wanted, cfg, retry=ReadRetry(5.0))) == len(wanted)
    assert failures  # it did fail once, and was read again


@pytest.mark.parametrize("tie", [False, True])  # Llama-3.2 1B and 3B tie their head to the embedding
def test_trained_checkpoint_exports_and_transformers_loads_it_with_every_key(tmp_path, tie):
    save_hf(tmp_path / "hf", tie=tie)
    engine = engine_from_hf(tmp_path / "hf")
    for _ in range(2):
        engine.train_step()
    catalog = commit(engine, tmp_path / "ck")
    files = export_hf(catalog, 2, str(tmp_path / "out"))
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(logits(loaded.eval(), IDS), logits(engine.model, IDS), rtol=0, atol=1e-5)


def test_hf_in_and_out_without_an_update_is_bit_identical(tmp_path):
    hf = save_hf(tmp_path / "hf")
    catalog = commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    export_hf(catalog, 0, str(tmp_path / "out"), max_shard_bytes=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    original, exported = hf.state_dict(), back.state_dict()
    assert set(original) == set(exported)
    for name, value in original.items():
        assert torch.equal(value, exported[name]), name


def test_cli_exports_bf16_and_refuses_a_model_transformers_cannot_hold(tmp_path, capsys):
    save_hf(tmp_path / "hf")
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck")
    url = f"file://{tmp_path}/ck"
    assert main(["ckpt", "export", url, "--format", "hf", "--dtype", "bf16", "--out", str(tmp_path / "b")]) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["num_key_value_heads"] == 2
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "b").dtype == torch.bfloat16
    assert main(["ckpt", "export", url, "--format", "hf", "--out", str(tmp_path / "b")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    gpt = Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=16), TrainConfig(steps=1, global_batch=1),
                 ParallelConfig(), rank=0, world_size=1)
    commit(gpt, tmp_path / "gpt")
    assert main(["ckpt", "export", f"file://{tmp_path}/gpt", "--format", "hf", "--out", str(tmp_path / "g")]) == 2
    assert "model.activation is 'gelu'" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_export_ships_the_recorded_tokenizer_checked_before_any_weight_is_written(tmp_path, capsys, monkeypatch):
    import hashlib

    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    import ckpt.hf_export
    from tests._corpus import documents, train_tokenizer

    save_hf(tmp_path / "hf")
    tok = train_tokenizer(tmp_path / "tok" / "tokenizer.json", documents(20, seed=1))
    recorded = {"url": f"file://{tok}", "sha256": hashlib.sha256(tok.read_bytes()).hexdigest(),
                "token_ids": {"eos_token_id": 1}}
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck", tokenizer=recorded)
    url = f"file://{tmp_path}/ck"
    assert main(["ckpt", "export", url, "--format", "hf", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == tok.read_bytes()
    text = "three plus four is seven"
    ids = Tokenizer.from_file(str(tok)).encode(text).ids
    assert AutoTokenizer.from_pretrained(tmp_path / "a")(text)["input_ids"] == ids
    train_tokenizer(tok, documents(20, seed=2))  # another tokenizer where the job's was
    monkeypatch.setattr(ckpt.hf_export, "write_safetensors", lambda *a, **k: pytest.fail("weights written first"))
    assert main(["ckpt", "export", url, "--format", "hf", "--out", str(tmp_path / "b")]) == 2
    assert "is not the tokenizer the job trained with" in capsys.readouterr().err and not (tmp_path / "b").exists()
    unreachable = ["--tokenizer", "htps://host/tokenizer.json"]  # a store the command's options do not reach
    assert main(["ckpt", "export", url, "--format", "hf", "--out", str(tmp_path / "b"), *unreachable]) == 2
    err = capsys.readouterr().err
    assert "the tokenizer at htps://host cannot be reached" in err and "Traceback" not in err


def test_export_takes_a_tokenizer_file_of_any_name_as_data_prepare_does(tmp_path):
    import hashlib

    from transformers import AutoTokenizer

    from tests._corpus import documents, train_tokenizer

    save_hf(tmp_path / "hf")
    tok = train_tokenizer(tmp_path / "tok" / "llama3-tokenizer.json", documents(20, seed=1))
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (tmp_path / "tok" / "tokenizer.model").write_bytes(b"a SentencePiece model")  # a slow tokenizer's file
    recorded = {"url": f"file://{tok}", "sha256": hashlib.sha256(tok.read_bytes()).hexdigest(),
                "token_ids": {"eos_token_id": 1}}
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck", tokenizer=recorded)
    assert main(["ckpt", "export", f"file://{tmp_path}/ck", "--format", "hf", "--out", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert (tmp_path / "a" / "tokenizer_config.json").exists()  # the files beside it come along
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == b"a SentencePiece model"
    AutoTokenizer.from_pretrained(tmp_path / "a")


def test_a_directory_with_a_weight_undying_would_drop_is_refused(tmp_path):
    hf = save_hf(tmp_path / "hf")
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(state, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias.*dropped"):
        engine_from_hf(tmp_path / "hf")


def test_directories_transformers_loads_load_alike_old_rotary_tables_a_stale_index_a_head_alone(tmp_path):
    from safetensors.torch import save_file

    hf = save_hf(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    old = {**state, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(2)}}
    save_file(old, str(tmp_path / "hf" / "model.safetensors"))  # transformers recomputes (and drops) those
    # A sharded save left behind by an earlier save_pretrained: the single file wins, as in transformers.
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        name: "model-00001-of-00002.safetensors" for name in state}}))
    torch.testing.assert_close(logits(engine_from_hf(tmp_path / "hf").model, IDS), logits(hf, IDS), rtol=0,
                               atol=1e-5)
    tied = save_hf(tmp_path / "tied", tie=True)
    alone = {k: v.contiguous() for k, v in tied.state_dict().items() if k != "model.embed_tokens.weight"}
    assert "lm_head.weight" in alone
    save_file(alone, str(tmp_path / "tied" / "model.safetensors"))  # the tie stored as the head alone
    torch.testing.assert_close(logits(engine_from_hf(tmp_path / "tied").model, IDS), logits(tied, IDS), rtol=0,
                               atol=1e-5)


def test_a_tied_config_over_weights_with_another_head_is_refused_an_equal_copy_is_not(tmp_path):
    from safetensors.torch import save_file

    from orchestrator.spec.data_check import data_problems
    from orchestrator.spec.job_spec import validate_spec

    tied = save_hf(tmp_path / "hf", tie=True)
    state = {k: v.contiguous() for k, v in tied.state_dict().items()}
    spec = validate_spec({"name": "j", "model": {"from_hf": str(tmp_path / "hf")}, "data": {"source": "synthetic"},
                          "train": {"steps": 2, "global_batch": 2}, "checkpoint": {"url": f"file://{tmp_path}/ck"}})
    for head, refused in ((state["model.embed_tokens.weight"].to(torch.bfloat16).float(), False),
                          (state["model.embed_tokens.weight"] + 1e-3, True)):
        embedding = state["model.embed_tokens.weight"].to(torch.bfloat16).float()
        save_file({**state, "model.embed_tokens.weight": embedding.to(torch.bfloat16), "lm_head.weight": head},
                  str(tmp_path / "hf" / "model.safetensors"))
        problems = data_problems(spec)
        assert [p.field for p in problems] == (["model.from_hf"] if refused else []), problems
        assert not refused or "tie_word_embeddings to false" in problems[0].message


@pytest.mark.parametrize("header, words", [
    (b"[1]", "not a JSON object"), (b"\xff", "not UTF-8 JSON"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode(), "does not hold"),
    (json.dumps({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}).encode(), "dtype 'Q4'"),
    (json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}).encode(), "overlap"),
])
def test_bad_safetensors_headers_are_refused_by_name(header, words):
    header += b" " * (-len(header) % 8)  # as writers pad it, so tensors start aligned
    blob = struct.pack("<Q", len(header)) + header + b"\0" * 16
    with pytest.raises(BadSafetensors, match=words):
        parse_header(blob, len(blob), "m.safetensors")


def test_a_fine_tune_of_a_pretrained_model_records_its_special_token_ids_and_the_data_s_end(tmp_path):
    import json

    import numpy as np
    from transformers import GenerationConfig, LlamaConfig

    from ckpt.hf_export import data_provenance
    from tests._tokens import write_token_dataset
    from trainer.config import DataConfig, ModelConfig

    save_hf(tmp_path / "hf")  # config.json: bos 1, eos 2 (LlamaConfig's)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 7]}))
    write_token_dataset(tmp_path / "tokens", np.arange(3000) % 90, 90, eos_id=3)
    data = DataConfig(source="tokens", path=str(tmp_path / "tokens"), seq_len=16)
    recorded = data_provenance(data, ModelConfig(from_hf=str(tmp_path / "hf")))["tokenizer"]["token_ids"]
    assert recorded == {"bos_token_id": 1, "eos_token_id": [2, 7, 3]}  # a chat model's end ids, and the data's
    assert data_provenance(data)["tokenizer"]["token_ids"] == {"eos_token_id": 3}  # from scratch: the data's
    from ckpt.hf_export import save_hf as write_hf

    engine = engine_from_hf(tmp_path / "hf")
    write_hf(engine.model_config, dict(engine.model.named_parameters()), str(tmp_path / "out"), token_ids=recorded)
    assert LlamaConfig.from_pretrained(tmp_path / "out").bos_token_id == 1
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [2, 7, 3]


def test_a_chat_model_s_fine_tune_exports_its_chat_templates_and_decoding_settings(tmp_path):
    import numpy as np
    from transformers import AutoTokenizer, GenerationConfig

    from ckpt.hf_export import data_provenance
    from tests._corpus import documents, train_tokenizer
    from tests._tokens import write_token_dataset

    save_hf(tmp_path / "hf")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    chat = {**generation, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(chat))
    tok = train_tokenizer(tmp_path / "tok" / "tokenizer.json", documents(20, seed=1))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "tok" / "chat_template.jinja").write_text(template)  # transformers 5's spelling of a template
    (tmp_path / "tok" / "additional_chat_templates").mkdir()
    (tmp_path / "tok" / "additional_chat_templates" / "tool_use.jinja").write_text("tools: " + template)
    write_token_dataset(tmp_path / "tokens", np.arange(3000) % 90, 90, eos_id=3, tokenizer=f"file://{tok.parent}")
    data = DataConfig(source="tokens", path=str(tmp_path / "tokens"), seq_len=16)
    recorded = data_provenance(data, ModelConfig(from_hf=str(tmp_path / "hf")))["tokenizer"]
    recorded["sha256"] = None  # (the generated dataset records no real tokenizer hash)
    commit(engine_from_hf(tmp_path / "hf"), tmp_path / "ck", tokenizer=recorded)
    assert main(["ckpt", "export", f"file://{tmp_path}/ck", "--format", "hf", "--out", str(tmp_path / "a")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"
    assert (tmp_path / "a" / "additional_chat_templates" / "tool_use.jinja").read_text() == "tools: " + template
    exported = GenerationConfig.from_pretrained(tmp_path / "a")
    assert (exported.do_sample, exported.temperature, exported.top_p) == (True, 0.6, 0.9)
    assert exported.eos_token_id == [2, 7, 3] and exported.bos_token_id == 1  # the model's ends and the data's
