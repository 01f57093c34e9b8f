"""Llama-3 architecture: presets equal the published models, grouped-query attention and scaled
RoPE equal Hugging Face's LlamaForCausalLM, and config.json is read exactly or refused."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from orchestrator.spec.job_spec import SpecError, validate_spec  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.hf_config import architecture_from_hf, hf_config_of  # noqa: E402
from trainer.hf_names import from_hf, to_hf  # noqa: E402
from trainer.model import build_model, count_params, rope_inverse_frequencies  # noqa: E402

SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
HF_KW = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def hf_model(tie: bool = False, **kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(**{**HF_KW, **kw}, rope_theta=500000.0, rope_scaling=dict(SCALING), tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("preset, published", [
    ("llama3.2-1b", 1_235_814_400), ("llama3.2-3b", 3_212_749_824),
    ("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496),
])
def test_presets_have_the_published_parameter_counts(preset, published):
    assert count_params(ModelConfig(preset=preset)) == published


def test_count_params_counts_what_the_model_holds():
    cfg = ModelConfig(preset="tiny-llama")
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
    assert model.blocks[0].attn.k_proj.weight.shape == (cfg.kv_dim, cfg.d_model) == (32, 64)


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_hugging_face_llama_with_gqa_and_scaled_rope(tie):
    hf = hf_model(tie=tie)
    cfg = ModelConfig(**architecture_from_hf(hf.config.to_dict()))
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.rope_scaling.factor, cfg.tie_embeddings) == (2, 500000.0, 8.0, tie)
    ours = build_model(cfg, seed=1).eval()
    state = {from_hf(k): v for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    ours.load_state_dict(state, strict=True)
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)


def test_rope_frequencies_equal_hugging_face_llama3_scaling():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_model()
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    cfg = ModelConfig(**architecture_from_hf(hf.config.to_dict()))
    assert torch.equal(rope_inverse_frequencies(cfg), theirs)
    # The scaling stretches the long wavelengths only: the highest frequency is unchanged.
    plain = rope_inverse_frequencies(cfg.model_copy(update={"rope_scaling": None}))
    assert plain[0] == theirs[0] and plain[-1] / theirs[-1] == pytest.approx(8.0)


def test_names_map_one_to_one_and_refuse_strangers():
    cfg = ModelConfig(preset="tiny-llama")
    names = [n for n, _ in build_model(cfg, seed=0).named_parameters()]
    hf_names = set(hf_model(num_hidden_layers=cfg.n_layers).state_dict())
    assert {to_hf(n) for n in names} == hf_names
    assert [from_hf(to_hf(n)) for n in names] == names
    with pytest.raises(KeyError, match="pos_emb.weight"):
        to_hf("pos_emb.weight")
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_proj.bias"):
        from_hf("model.layers.0.self_attn.q_proj.bias")


def test_both_config_spellings_read_the_same_and_export_round_trips():
    five = hf_model().config.to_dict()  # transformers 5.x: rope_parameters
    four = {k: v for k, v in five.items() if k != "rope_parameters"}
    four.update(rope_theta=500000.0, rope_scaling={k: v for k, v in SCALING.items()})  # 4.x spelling
    assert architecture_from_hf(five) == architecture_from_hf(four)
    cfg = ModelConfig(**architecture_from_hf(five))
    assert ModelConfig(**architecture_from_hf(hf_config_of(cfg))) == cfg
    plain = dict(four, rope_scaling=None)
    assert architecture_from_hf(plain)["rope_scaling"] is None


@pytest.mark.parametrize("key, value, words", [
    ("attention_bias", True, "'attention_bias'"), ("hidden_act", "gelu", "'hidden_act'"),
    ("sliding_window", 4096, "'sliding_window'"), ("head_dim", 32, "'head_dim'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'rope_scaling.rope_type'"),
    ("model_type", "mistral", "'model_type'"),
])
def test_keys_that_cannot_be_represented_are_refused_by_name(key, value, words):
    config = {**HF_KW, "model_type": "llama", key: value}
    with pytest.raises(ValueError, match=words):
        architecture_from_hf(config)


def test_config_keys_no_transformers_llama_reads_are_accepted():
    marks = {"pretraining_tp": 2, "is_llama_config": True, "rope_interleaved": False, "unsloth_version": "2024.9",
             "_attn_implementation_autoset": True}
    assert architecture_from_hf({**HF_KW, "model_type": "llama", **marks}) == \
        architecture_from_hf({**HF_KW, "model_type": "llama"})


def test_from_hf_in_a_spec_reads_config_json_and_refuses_contradictions(tmp_path):
    hf_model().config.save_pretrained(tmp_path)
    base = {"name": "ft", "train": {"steps": 2, "global_batch": 2}, "checkpoint": {"url": f"file://{tmp_path}/ck"},
            "data": {"source": "synthetic"}}
    spec = validate_spec({**base, "model": {"from_hf": str(tmp_path), "max_seq_len": 128}})
    assert (spec.model.n_kv_heads, spec.model.max_seq_len, spec.model.rope_theta) == (2, 128, 500000.0)
    # what the driver hands each rank (the spec as data) validates again to the same model
    assert validate_spec(spec.model_dump(mode="json", by_alias=True)).model == spec.model
    with pytest.raises(SpecError) as err:
        validate_spec({**base, "model": {"from_hf": str(tmp_path), "n_heads": 8}})
    assert "model.n_heads=8 contradicts" in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({**HF_KW, "model_type": "llama", "attention_bias": True}))
    with pytest.raises(SpecError, match="attention_bias"):
        validate_spec({**base, "model": {"from_hf": str(tmp_path)}})


def test_tp_that_does_not_divide_the_kv_heads_is_refused_naming_both_fields():
    base = {"name": "j", "model": {"preset": "tiny-llama"}, "train": {"steps": 2, "global_batch": 4},
            "checkpoint": {"url": "file:///tmp/x"}, "parallel": {"tp": 4}}
    with pytest.raises(SpecError) as err:
        validate_spec(base)
    assert any(p.field == "parallel.tp" and "model.n_kv_heads = 2" in p.message for p in err.value.problems)


def test_pretrained_weights_without_a_data_section_are_refused_not_fine_tuned_on_synthetic_tokens(tmp_path):
    hf_model().config.save_pretrained(tmp_path)
    base = {"name": "ft", "train": {"steps": 2, "global_batch": 2}, "checkpoint": {"url": f"file://{tmp_path}/ck"},
            "model": {"from_hf": str(tmp_path)}}
    for data in ({}, {"data": {"seq_len": 64}}):
        with pytest.raises(SpecError) as err:
            validate_spec({**base, **data})
        [problem] = err.value.problems
        assert problem.field == "data.source" and "undying data prepare" in problem.message
    assert validate_spec({**base, "data": {"source": "synthetic"}}).data.source == "synthetic"  # on purpose


def test_plan_reads_the_architecture_from_config_json(tmp_path, capsys):
    from orchestrator.cli.main import main

    hf_model().config.save_pretrained(tmp_path / "hf")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: p\nmodel: {{from_hf: '{tmp_path / 'hf'}'}}\ntrain: {{steps: 10, global_batch: 8}}\n"
                    f"checkpoint: {{url: 'file://{tmp_path}/ck'}}\ndata: {{source: synthetic}}\n")
    assert main(["plan", str(spec), "--gpus", "4", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    # the GQA model of config.json, named by its directory; tp=4 is refused for its 2 kv heads
    assert f"model file://{tmp_path / 'hf'} (0.13M parameters)" in out, out
    assert "tp=4: 2 key/value heads not divisible by 4" in out


def test_absent_keys_mean_what_transformers_reads_and_missing_dimensions_are_refused():
    config = {**HF_KW, "model_type": "llama"}
    del config["rms_norm_eps"]
    arch = architecture_from_hf(config)
    assert arch["norm_eps"] == LlamaConfig(**{k: v for k, v in HF_KW.items() if k != "rms_norm_eps"}).rms_norm_eps
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="'intermediate_size': missing"):
        architecture_from_hf(config)
    partial = {**HF_KW, "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="rope_scaling.high_freq_factor': missing"):
        architecture_from_hf(partial)


def test_both_rope_spellings_must_agree():
    five = hf_model().config.to_dict()
    both = {**five, "rope_theta": 500000.0, "rope_scaling": dict(SCALING)}
    assert architecture_from_hf(both) == architecture_from_hf(five)
    with pytest.raises(ValueError, match="'rope_theta'"):
        architecture_from_hf({**five, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="'rope_scaling': differs"):
        architecture_from_hf({**both, "rope_scaling": {**SCALING, "factor": 4.0}})


def test_from_hf_is_read_as_an_absolute_url_and_a_malformed_config_is_a_spec_error(tmp_path, monkeypatch):
    import json

    from trainer.config import ModelConfig

    hf_model().config.save_pretrained(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    assert ModelConfig(from_hf="hf").from_hf == f"file://{tmp_path}/hf"  # the ranks run elsewhere
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_scaling": "llama3"}))
    with pytest.raises(ValueError, match=r"config key 'rope_scaling': 'llama3' is not a JSON object"):
        ModelConfig(from_hf="hf")
    # A Hub model id is no directory: the error says how to get one, not "no config.json" under the cwd.
    (tmp_path / "meta-llama" / "Llama-3.2-1B").mkdir(parents=True)  # a download of it here is read as one
    with pytest.raises(ValueError, match=r"no config.json at file://.*/meta-llama/Llama-3.2-1B"):
        ModelConfig(from_hf="meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match=r"looks like a Hugging Face Hub model id.*"
                                         r"`hf download meta-llama/Llama-3.2-3B --local-dir DIR`"):
        ModelConfig(from_hf="meta-llama/Llama-3.2-3B")


def test_a_shorter_training_context_keeps_the_declared_one_in_the_export(tmp_path):
    # generate() and vLLM read max_position_embeddings as the longest input: a fine-tune at a short
    # max_seq_len exports the context the weights declared, a longer one the longer.
    hf_model().config.save_pretrained(tmp_path)
    declared = HF_KW["max_position_embeddings"]
    short = ModelConfig(from_hf=str(tmp_path), max_seq_len=declared // 4)
    assert short.max_seq_len == declared // 4 and hf_config_of(short)["max_position_embeddings"] == declared
    longer = ModelConfig(from_hf=str(tmp_path), max_seq_len=declared * 2)
    assert hf_config_of(longer)["max_position_embeddings"] == declared * 2
    assert LlamaConfig(**hf_config_of(short)).max_position_embeddings == declared  # what transformers reads
    assert ModelConfig(preset="llama3.1-8b", max_seq_len=4096).max_position_embeddings == 131072
    assert ModelConfig(preset="tiny", max_seq_len=64, max_position_embeddings=512).max_position_embeddings == 512
    assert ModelConfig(preset="tiny", max_seq_len=64, max_position_embeddings=32).max_position_embeddings == 64


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}},  # no top-level rope_theta
    {"rope_scaling": {**SCALING, "rope_theta": 500000.0}},
    {"rope_parameters": {**SCALING, "rope_theta": 500000.0}, "rope_scaling": None},  # a 4.x null beside it
])
def test_a_theta_inside_the_rope_settings_is_the_one_transformers_reads(rope):
    config = {**HF_KW, "model_type": "llama", **rope}
    theirs = LlamaConfig.from_dict(config).rope_parameters
    assert architecture_from_hf(config)["rope_theta"] == theirs["rope_theta"] == 500000.0


@pytest.mark.parametrize("rope", [
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
     "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}},
])
def test_two_thetas_that_disagree_are_refused(rope):
    with pytest.raises(ValueError, match="keep one value|differs from rope_parameters; keep one of them"):
        architecture_from_hf({**HF_KW, "model_type": "llama", **rope})


@pytest.mark.parametrize("key, value, words", [
    ("rope_theta", [1], "'rope_theta': [1] is not a positive number"),
    ("rope_theta", "abc", "'rope_theta': 'abc' is not a positive number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": {}}, "'rope_parameters.rope_theta': {}"),
    ("num_attention_heads", "4", "'num_attention_heads': '4' is not a positive whole number"),
    ("head_dim", "16", "'head_dim': '16' is not a positive whole number"),
    ("hidden_size", None, "'hidden_size': missing"),
    ("vocab_size", 0, "'vocab_size': 0 is not a positive whole number"),
    ("rms_norm_eps", -1, "'rms_norm_eps': -1 is not a positive number"),
    ("tie_word_embeddings", "yes", "'tie_word_embeddings': 'yes' is not true or false"),
    ("rms_norm_eps", None, "'rms_norm_eps': null; give its value or remove the key"),
    ("tie_word_embeddings", None, "'tie_word_embeddings': null"),
])
def test_a_config_json_value_of_the_wrong_kind_is_named_by_its_key_in_config_json(tmp_path, key, value, words):
    (tmp_path / "config.json").write_text(json.dumps({**HF_KW, "model_type": "llama", key: value}))
    base = {"name": "ft", "train": {"steps": 2, "global_batch": 2}, "checkpoint": {"url": f"file://{tmp_path}/ck"}}
    with pytest.raises(SpecError) as err:
        validate_spec({**base, "model": {"from_hf": str(tmp_path)}})
    assert words in str(err.value) and "config.json" in str(err.value) and "from_hf=" in str(err.value)
