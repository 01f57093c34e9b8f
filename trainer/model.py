"""A decoder-only transformer (GPT-2 or Llama-3 shaped), meant to be read top to bottom.

    token ids -> token embedding (+ learned positions) -> dropout
              -> n_layers x Block -> final norm -> LM head -> logits
    Block:       x = x + attention(norm(x))
                 x = x + mlp(norm(x))                    (pre-norm, as GPT-2 and Llama)

Positions are rotary (RoPE, applied to queries and keys inside attention, with a configurable
base `rope_theta` and Llama-3.1 frequency scaling) or a learned table added to the embeddings.
Attention is grouped-query when `n_kv_heads < n_heads`: query head h reads key/value head
h // (n_heads / n_kv_heads), the layout of Hugging Face's `repeat_kv`. The LM head reuses the
token embedding when embeddings are tied. No linear layer or norm has a bias. With swiglu,
rmsnorm, rope and these options the model is exactly Hugging Face's LlamaForCausalLM
(parameter names map one to one: trainer/hf_names.py).

Parameter names are part of the checkpoint format (`Engine.state_tensors` stores them as
"model/<name>"), so they must not change:

    tok_emb.weight                  pos_emb.weight (learned positions only)
    blocks.<i>.attn_norm.weight     blocks.<i>.attn.{q,k,v,o}_proj.weight
    blocks.<i>.mlp_norm.weight      blocks.<i>.mlp.{gate,up,down}_proj.weight (gate: swiglu only)
    norm.weight                     lm_head.weight (untied embeddings only)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.init_values import init_parameters, materialize
from trainer.seeding import derive_seed


def rope_inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """theta^(-2j/head_dim) for j < head_dim/2, in fp32, with Llama-3.1 scaling when configured.

    Computed as Hugging Face computes it (`1 / theta^(2j/d)`, then `_compute_llama3_parameters`),
    so the tables match its rotary embedding to the last bit of the frequencies.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are stretched by `factor`; short ones kept.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (max_seq_len, head_dim), in fp32.

    Channel pair (j, j + head_dim/2) of position t is rotated by t * inv_freq[j] (the "rotate
    half" layout of GPT-NeoX and Llama; RoFormer, arXiv:2104.09864).
    """
    inv_freq = rope_inverse_frequencies(cfg)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, head_dim) by the tables' first T rows."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=False)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Set by trainer.tensor_parallel (tp without sequence parallelism): this rank's tp index.
        # The tp ranks' generators agree there (their activations are replicas), but each rank's
        # heads are other heads: their attention dropout must draw other masks, as one process's do.
        self.head_salt: int | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Head counts come from the projections' widths, not the config, so that a
        # tensor-parallel rank holding a slice of the query and key/value heads runs this
        # code unchanged (tp divides n_kv_heads, so its query heads read its own kv heads).
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            # Hugging Face's repeat_kv: kv head g serves query heads g*group .. g*group+group-1.
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = self._attend(q, k, v).transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.o_proj(y))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if not p or self.head_salt is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        # One draw of the shared generator (the same on every tp rank, and again when activation
        # recomputation replays the forward), salted with the rank: its own masks, reproducibly;
        # the shared generator advances alike on every rank, so the replicated dropouts still agree.
        base = int(torch.randint(0, 2**62, ()))
        with torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else []):
            torch.manual_seed(derive_seed(base, "tp", self.head_salt))
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class MLP(nn.Module):
    """gelu: down(gelu(up(x))).  swiglu: down(silu(gate(x)) * up(x)) (Shazeer, arXiv:2002.05202)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            hidden = F.gelu(self.up_proj(x))
        return self.dropout(self.down_proj(hidden))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size). Build it with `build_model`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.position == "rope" and cfg.head_dim % 2:
            raise ValueError(
                f"RoPE needs an even head dimension, got d_model/n_heads = {cfg.head_dim}: "
                "change n_heads or use model.position='learned'"
            )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.position == "rope":
            # Derived from the config, so not part of the state dict (persistent=False).
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.tok_emb(input_ids)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(seq, device=input_ids.device))
        else:
            rope = (self.rope_cos[:seq], self.rope_sin[:seq])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        x = self.norm(x)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation (trainer.init_values.param_std), each value a pure function of
        (seed, parameter name, element offset) (trainer.init_values).

        So a parameter's initial value does not depend on which other parameters exist (a
        pipeline stage holding layers 4..7 initialises them exactly as the full model does),
        nor on how it is cut: called on a model whose parameters are DTensor shards (tensor
        parallel, FSDP), each rank fills exactly the slice it holds.
        """
        init_parameters(self, self.cfg, seed)
        init_rope_buffers(self, self.cfg)


@torch.no_grad()
def init_rope_buffers(module: nn.Module, cfg: ModelConfig) -> None:
    """Fill `module`'s RoPE tables (rope_cos, rope_sin), if it has them and they are not on meta."""
    if getattr(module, "rope_cos", None) is None or module.rope_cos.is_meta:
        return
    cos, sin = rope_tables(cfg)
    module.rope_cos.copy_(cos)
    module.rope_sin.copy_(sin)


def meta_model(cfg: ModelConfig) -> GPT:
    """The model for `cfg` on the meta device: shapes only, no memory, no values. Parallelise
    it there, then `trainer.init_values.materialize` it (each rank allocates its shards)."""
    with torch.device("meta"):
        return GPT(cfg)


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> GPT:
    """The whole model for `cfg`, initialised deterministically from `seed`, on `device`.

    Built on the meta device first so that no memory is spent on a throw-away default
    initialisation and the global RNG is never touched; its values are those every sharded
    layout holds slices of (trainer.init_values).
    """
    return materialize(meta_model(cfg), seed, device)


def count_params(cfg: ModelConfig) -> int:
    """Number of distinct parameters of `build_model(cfg)`, from the config alone."""
    d, vocab = cfg.d_model, cfg.vocab_size
    per_block = cfg.attention_params + cfg.mlp_params + 2 * d
    total = vocab * d + cfg.n_layers * per_block + d
    if cfg.position == "learned":
        total += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        total += vocab * d
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`.

    6 * N + 12 * n_layers * d_model * seq_len (PaLM, Chowdhery et al. 2022, appendix B):
    N counts the weights that multiply activations (every projection and the LM head, not
    the embedding lookups or norms), 2 FLOPs per weight forward and 4 backward. The second
    term is QK^T and attention-times-V, counted without the causal halving as in PaLM, so
    MFU figures compare with the published ones.
    """
    d = cfg.d_model
    matmul_params = cfg.n_layers * (cfg.attention_params + cfg.mlp_params) + cfg.vocab_size * d
    return 6 * matmul_params + 12 * cfg.n_layers * d * seq_len
