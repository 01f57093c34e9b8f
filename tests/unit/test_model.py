import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainer.config import ModelConfig
from trainer.model import apply_rope, build_model, count_params, flops_per_token, rope_tables

VARIANTS = {
    "gpt2-like": dict(),
    "llama-like": dict(activation="swiglu", norm="rmsnorm", tie_embeddings=False),
    "learned-positions": dict(position="learned", activation="swiglu"),
}


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(preset="tiny", **overrides)


def test_parameter_names_are_stable():
    names = [name for name, _ in build_model(tiny(), seed=0).named_parameters()]
    block0 = [
        "blocks.0.attn_norm.weight", "blocks.0.attn.q_proj.weight", "blocks.0.attn.k_proj.weight",
        "blocks.0.attn.v_proj.weight", "blocks.0.attn.o_proj.weight", "blocks.0.mlp_norm.weight",
        "blocks.0.mlp.up_proj.weight", "blocks.0.mlp.down_proj.weight",
    ]
    assert names[:9] == ["tok_emb.weight", *block0]
    assert names[-1] == "norm.weight"
    assert len(names) == 1 + 4 * len(block0) + 1

    untied = [n for n, _ in build_model(tiny(**VARIANTS["llama-like"]), seed=0).named_parameters()]
    assert "lm_head.weight" in untied and "blocks.3.mlp.gate_proj.weight" in untied
    learned = [n for n, _ in build_model(tiny(position="learned"), seed=0).named_parameters()]
    assert learned[:2] == ["tok_emb.weight", "pos_emb.weight"]


def test_state_dict_holds_parameters_only():
    model = build_model(tiny(), seed=0)
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_count_params_matches_the_built_model(variant):
    cfg = tiny(**VARIANTS[variant])
    model = build_model(cfg, seed=0)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())


def test_count_params_of_gpt2_small_shape():
    # GPT-2 small has 124.4M parameters with its biases; without biases or positions 123.6M.
    assert count_params(ModelConfig(preset="small", vocab_size=50257)) == 123_551_232
    learned = ModelConfig(preset="small", vocab_size=50257, position="learned")
    assert count_params(learned) == 123_551_232 + 1024 * 768


def test_same_seed_same_weights_and_global_rng_untouched():
    rng_before = torch.get_rng_state()
    first, second = build_model(tiny(), seed=7), build_model(tiny(), seed=7)
    other = build_model(tiny(), seed=8)
    assert torch.equal(torch.get_rng_state(), rng_before)
    triples = zip(first.named_parameters(), second.parameters(), other.parameters(), strict=True)
    for (name, a), b, c in triples:
        assert torch.equal(a, b), name
        if a.ndim == 2:
            assert not torch.equal(a, c), name


def test_init_is_gpt2_style():
    cfg = ModelConfig(vocab_size=512, n_layers=8, n_heads=4, d_model=256, d_ff=1024)
    params = dict(build_model(cfg, seed=0).named_parameters())
    assert params["blocks.0.attn.q_proj.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert params["blocks.5.attn.o_proj.weight"].std().item() == pytest.approx(residual, rel=0.02)
    assert params["blocks.5.mlp.down_proj.weight"].std().item() == pytest.approx(residual, rel=0.02)
    assert torch.equal(params["norm.weight"], torch.ones(cfg.d_model))


def test_parameter_init_does_not_depend_on_other_parameters():
    # A pipeline stage (or a deeper model) initialises the layers it shares identically.
    shallow = dict(build_model(tiny(n_layers=2), seed=3).named_parameters())
    deep = dict(build_model(tiny(n_layers=4), seed=3).named_parameters())
    assert torch.equal(shallow["blocks.1.mlp.up_proj.weight"], deep["blocks.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_is_causal(variant):
    model = build_model(tiny(**VARIANTS[variant]), seed=0)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 32, 256)
    assert torch.equal(logits[:, :20], logits_changed[:, :20])
    assert not torch.allclose(logits[:, 20:], logits_changed[:, 20:])


@pytest.mark.parametrize("tied", [True, False])
def test_tied_head_reuses_the_embedding(tied):
    model = build_model(tiny(tie_embeddings=tied), seed=0)
    tokens = torch.zeros(1, 4, dtype=torch.long)  # token 5 is not in the input
    with torch.no_grad():
        before = model(tokens)
        model.tok_emb.weight[5] += 1.0
        after = model(tokens)
    # Only the tied head reads embedding row 5, as the output projection of token 5.
    assert torch.equal(before[..., 5], after[..., 5]) is not tied
    assert torch.equal(before[..., 6], after[..., 6])


def test_rope_rotates_pairs_and_preserves_norm():
    cos, sin = rope_tables(ModelConfig(vocab_size=16, n_layers=1, n_heads=1, d_model=8, max_seq_len=16))
    x = torch.randn(1, 2, 16, 8)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(rotated[:, :, 0], x[:, :, 0])  # position 0 is not rotated
    # Dot products depend only on the distance between positions (relative encoding).
    q, k = torch.randn(8), torch.randn(8)
    q_at = lambda t: apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 16, 8), cos, sin)[0, 0, t]  # noqa: E731
    k_at = lambda t: apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 16, 8), cos, sin)[0, 0, t]  # noqa: E731
    torch.testing.assert_close(q_at(5) @ k_at(2), q_at(13) @ k_at(10))


def test_longer_than_max_seq_len_is_refused():
    model = build_model(tiny(max_seq_len=16), seed=0)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_odd_head_dim_with_rope_is_refused():
    with pytest.raises(ValueError, match="d_model / n_heads = 3 is odd"):  # by the spec, before any rank
        ModelConfig(vocab_size=16, n_layers=1, n_heads=2, d_model=6)
    cfg = ModelConfig(vocab_size=16, n_layers=1, n_heads=2, d_model=6, position="learned")
    with pytest.raises(ValueError, match="even head dimension"):  # and by the model, whatever built the config
        build_model(cfg.model_copy(update={"position": "rope"}), seed=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_flops_per_token_equals_counted_training_flops(variant):
    cfg = tiny(**VARIANTS[variant])
    model = build_model(cfg, seed=0)
    batch, seq = 2, 48
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    # The math backend runs attention as matmuls, which the flop counter sees.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq) * batch * seq


def test_flops_per_token_by_hand():
    cfg = tiny()
    matmul_params = 4 * (4 * 64 * 64 + 2 * 64 * 256) + 256 * 64
    assert flops_per_token(cfg, 128) == 6 * matmul_params + 12 * 4 * 64 * 128


def test_dropout_is_active_in_training_only():
    model = build_model(tiny(dropout=0.5), seed=0)
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(tokens), model(tokens))
        model.eval()
        assert torch.equal(model(tokens), model(tokens))
