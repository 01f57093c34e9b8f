"""Typed configuration of what a rank trains: model, data, optimisation, parallel layout.

These are the `model:`, `data:`, `train:` and `parallel:` sections of the job spec
(`orchestrator.spec.job_spec.JobSpec`). They are validated once, at the edge, before any rank
starts; the engine trusts them afterwards. Cross-section checks (heads % tp, batch
divisibility, ...) live in the job spec because they need more than one section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    # Unknown keys are user mistakes (a typo silently ignored is a wasted GPU-day).
    model_config = ConfigDict(extra="forbid", frozen=True)


# Model shapes by name. Explicit dimensions in the spec override the preset's.
MODEL_PRESETS: dict[str, dict] = {
    # For tests and CPU demos: trains in milliseconds per step.
    "tiny": dict(vocab_size=256, n_layers=4, n_heads=4, d_model=64, d_ff=256, max_seq_len=256),
    # GPT-2 small shape (124M parameters).
    "small": dict(vocab_size=50304, n_layers=12, n_heads=12, d_model=768, d_ff=3072, max_seq_len=1024),
    # Llama-3.2-1B-like shape.
    "1b": dict(vocab_size=128256, n_layers=16, n_heads=32, d_model=2048, d_ff=8192, max_seq_len=4096,
               activation="swiglu", norm="rmsnorm", tie_embeddings=True),
    # Llama-3-8B-like shape.
    "8b": dict(vocab_size=128256, n_layers=32, n_heads=32, d_model=4096, d_ff=14336, max_seq_len=8192,
               activation="swiglu", norm="rmsnorm", tie_embeddings=False),
}


class ModelConfig(_Strict):
    """A GPT-style decoder. Either `preset`, explicit dimensions, or a preset with overrides."""

    preset: Literal["tiny", "small", "1b", "8b"] | None = None
    vocab_size: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    d_model: int | None = Field(None, gt=0)
    d_ff: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    activation: Literal["gelu", "swiglu"] = "gelu"
    position: Literal["rope", "learned"] = "rope"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    tie_embeddings: bool = True
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_eps: float = Field(1e-5, gt=0.0)

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        base = dict(MODEL_PRESETS[self.preset]) if self.preset else {}
        explicit = {k: v for k, v in self.__dict__.items() if k in self.model_fields_set and k != "preset"}
        base.update(explicit)
        for key, value in base.items():
            object.__setattr__(self, key, value)
        missing = [k for k in ("vocab_size", "n_layers", "n_heads", "d_model") if getattr(self, k) is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}: give a preset (tiny, small, 1b, 8b) or every dimension"
            )
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.max_seq_len is None:
            object.__setattr__(self, "max_seq_len", 2048)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                "choose n_heads that divides d_model"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class DataConfig(_Strict):
    """Where samples come from. Sample i of global step s is a pure function of (seed, s, i)."""

    source: Literal["synthetic", "text"] = "synthetic"
    path: str | None = None  # fsspec URL or local path of a UTF-8 text file, for source=text
    seq_len: int = Field(64, gt=1)
    seed: int = 0
    # Synthetic samples have lengths drawn in [min_len_fraction * seq_len, seq_len] so that
    # padding and token weighting are exercised; 1.0 gives fixed-length samples.
    min_len_fraction: float = Field(0.5, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _path_for_text(self) -> DataConfig:
        if self.source == "text" and not self.path:
            raise ValueError("source 'text' needs data.path: the URL or path of a UTF-8 text file")
        return self


class TrainConfig(_Strict):
    steps: int = Field(..., gt=0)
    global_batch: int = Field(..., gt=0, description="samples per optimizer step, over all ranks")
    micro_batch: int = Field(1, gt=0, description="samples per forward/backward on one rank")
    lr: float = Field(3e-4, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = Field(1.0, gt=0.0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    deterministic: bool = True


class ParallelConfig(_Strict):
    dp: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    zero: Literal[0, 1, 2, 3] = 0
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream"] = "1f1b"
    # Model chunks per pipeline rank: interleaved 1F1B needs >= 2; zero-bubble (V shape) uses 2.
    # None picks the schedule's default (trainer.costmodel.layout.default_virtual_stages).
    virtual_stages: int | None = Field(None, gt=0)
    ddp_bucket_mb: float = Field(25.0, gt=0.0)
    # Activation recomputation: none, selective (keep matmul outputs, recompute the cheap
    # element-wise ops and attention internals) or block (keep only each block's input).
    recompute: Literal["none", "selective", "block"] = "none"
    # Megatron sequence parallelism for norms and dropout when tp > 1 (ignored when tp = 1).
    sequence_parallel: bool = True

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp
