"""Typed configuration of what a rank trains: model, data, optimisation, parallel layout.

These are the `model:`, `data:`, `train:` and `parallel:` sections of the job spec
(`orchestrator.spec.job_spec.JobSpec`). They are validated once, at the edge, before any rank
starts; the engine trusts them afterwards. Cross-section checks (heads % tp, batch
divisibility, ...) live in the job spec because they need more than one section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trainer.spec_section import SpecSection
from trainer.urls import absolute_url


class _Strict(SpecSection):  # unknown keys refused, frozen, no yes/no for a number (trainer.spec_section)
    def __hash__(self) -> int:
        # By value, through the canonical JSON: a section may hold lists and mappings (a data
        # mixture, storage options), which pydantic's field-tuple hash cannot hash.
        return hash(self.model_dump_json())


class RopeScaling(_Strict):
    """Llama-3.1 RoPE frequency scaling (Hugging Face `rope_type: llama3`; Meta's llama-models
    `apply_scaling`): wavelengths longer than original_max_position_embeddings / low_freq_factor
    are stretched by `factor`, shorter than original / high_freq_factor are kept, and the band
    between is interpolated smoothly."""

    rope_type: Literal["llama3"] = Field("llama3", description="the scaling rule (Llama 3.1's is the only one)")
    factor: float = Field(..., gt=0.0, description="how much longer the longest wavelengths are stretched")
    low_freq_factor: float = Field(1.0, gt=0.0, description="wavelengths above original / low_freq_factor are "
                                   "stretched by `factor`")
    high_freq_factor: float = Field(4.0, gt=0.0, description="wavelengths below original / high_freq_factor are "
                                    "kept; between the two bounds they are interpolated")
    original_max_position_embeddings: int = Field(8192, gt=0, description="context length the model was first "
                                                  "trained at")

    @model_validator(mode="after")
    def _band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                             f"{self.low_freq_factor}: the interpolated band would be empty")
        return self


_LLAMA = dict(activation="swiglu", norm="rmsnorm", position="rope", norm_eps=1e-5, rope_theta=500000.0)
_LLAMA_3_1_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA_3_2_SCALING = dict(_LLAMA_3_1_SCALING, factor=32.0)

# Model shapes by name. Explicit dimensions in the spec override the preset's. The Llama
# presets are the published architectures (their config.json on the Hugging Face hub): the
# parameter counts equal the published ones (tests/unit/test_llama.py).
MODEL_PRESETS: dict[str, dict] = {
    # For tests and CPU demos: trains in milliseconds per step.
    "tiny": dict(vocab_size=256, n_layers=4, n_heads=4, d_model=64, d_ff=256, max_seq_len=256),
    # A tiny Llama-3 (grouped-query attention, scaled RoPE) for tests and CPU demos.
    "tiny-llama": dict(_LLAMA, vocab_size=256, n_layers=4, n_heads=4, n_kv_heads=2, d_model=64, d_ff=192,
                       max_seq_len=256, tie_embeddings=False,
                       rope_scaling=dict(_LLAMA_3_1_SCALING, original_max_position_embeddings=64)),
    # GPT-2 small shape (124M parameters).
    "small": dict(vocab_size=50304, n_layers=12, n_heads=12, d_model=768, d_ff=3072, max_seq_len=1024),
    # meta-llama/Llama-3.2-1B: 1.24 B parameters.
    "llama3.2-1b": dict(_LLAMA, vocab_size=128256, n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048,
                        d_ff=8192, max_seq_len=131072, tie_embeddings=True, rope_scaling=_LLAMA_3_2_SCALING),
    # meta-llama/Llama-3.2-3B: 3.21 B parameters.
    "llama3.2-3b": dict(_LLAMA, vocab_size=128256, n_layers=28, n_heads=24, n_kv_heads=8, d_model=3072,
                        d_ff=8192, max_seq_len=131072, tie_embeddings=True, rope_scaling=_LLAMA_3_2_SCALING),
    # meta-llama/Llama-3.1-8B: 8.03 B parameters.
    "llama3.1-8b": dict(_LLAMA, vocab_size=128256, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096,
                        d_ff=14336, max_seq_len=131072, tie_embeddings=False, rope_scaling=_LLAMA_3_1_SCALING),
    # meta-llama/Llama-3.1-70B: 70.6 B parameters (for `undying plan`).
    "llama3.1-70b": dict(_LLAMA, vocab_size=128256, n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192,
                         d_ff=28672, max_seq_len=131072, tie_embeddings=False, rope_scaling=_LLAMA_3_1_SCALING),
}
PresetName = Literal["tiny", "tiny-llama", "small", "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b"]


class ModelConfig(_Strict):
    """A decoder-only transformer: `preset`, explicit dimensions, a preset with overrides, or
    `from_hf` (a Hugging Face model directory whose config.json gives the architecture and
    whose safetensors give the initial weights; see trainer/hf_config.py)."""

    preset: PresetName | None = Field(None, description="a named shape (MODEL_PRESETS in trainer/config.py); "
                                      "explicit dimensions override its values")
    from_hf: str | None = Field(None, description="a Hugging Face model directory: its config.json gives the "
                                "architecture, its safetensors the initial weights")
    # Where the weights live and how to reach them, not what the model is: architecture() and the
    # spec hash leave it out (credentials must not reach a manifest).
    storage_options: dict = Field(default_factory=dict, description="fsspec options for from_hf (e.g. "
                                  "endpoint_url); credentials go in storage_options_file")
    vocab_size: int | None = Field(None, gt=0, description="token ids the embedding holds (from the preset when unset)")
    n_layers: int | None = Field(None, gt=0, description="transformer blocks")
    n_heads: int | None = Field(None, gt=0, description="attention (query) heads; must divide d_model")
    # Grouped-query attention: Ainslie et al. 2023, arXiv:2305.13245.
    n_kv_heads: int | None = Field(None, gt=0, description="key/value heads, each shared by n_heads / n_kv_heads "
                                   "query heads (grouped-query attention); unset: n_heads")
    d_model: int | None = Field(None, gt=0, description="hidden width")
    d_ff: int | None = Field(None, gt=0, description="MLP width; unset: 4 * d_model")
    max_seq_len: int | None = Field(None, gt=0, description="longest sequence the positions cover; unset: 2048")
    # What transformers' generate() and vLLM read as the longest input: a fine-tune at a shorter
    # context must not export a model that claims only that context.
    max_position_embeddings: int | None = Field(
        None, gt=0, description="context length an exported config.json declares (Hugging Face's "
                                "max_position_embeddings); below max_seq_len it is raised to it; unset: the "
                                "preset's or from_hf's context, so training at a shorter max_seq_len keeps it, "
                                "else max_seq_len")
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation (swiglu: three matrices)")
    position: Literal["rope", "learned"] = Field("rope", description="rotary or learned absolute positions")
    rope_theta: float = Field(10000.0, gt=0.0, description="RoPE base frequency")
    rope_scaling: RopeScaling | None = None
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="normalisation layer")
    tie_embeddings: bool = Field(True, description="the output projection shares the input embedding's weights")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability (0: none)")
    norm_eps: float = Field(1e-5, gt=0.0, description="epsilon of the normalisation layers")

    @model_validator(mode="before")
    @classmethod
    def _from_hf_config(cls, data):
        # A Hugging Face directory supplies every architecture key; explicit keys may not
        # contradict it (they would silently train another model than the weights describe).
        if isinstance(data, dict) and data.get("from_hf") and isinstance(data["from_hf"], str):
            from trainer.hf_config import merge_hf_architecture, refuse_a_hub_id

            try:  # absolute now: the ranks, in other working directories, read its safetensors
                refuse_a_hub_id(data["from_hf"])
                where = absolute_url(data["from_hf"])
            except ValueError as err:
                raise ValueError(f"from_hf: {err}") from None
            return merge_hf_architecture({**data, "from_hf": where})
        return data

    @model_validator(mode="after")
    def _options_need_a_directory(self) -> ModelConfig:
        if self.storage_options and not self.from_hf:
            raise ValueError("storage_options are for reading from_hf, and from_hf is not set; remove "
                             "model.storage_options (and model.storage_options_file) or set model.from_hf")
        return self

    @model_validator(mode="after")
    def _fill_from_preset(self) -> ModelConfig:
        base = dict(MODEL_PRESETS[self.preset]) if self.preset else {}
        explicit = {k: v for k, v in self.__dict__.items() if k in self.model_fields_set and k != "preset"}
        base.update(explicit)
        if isinstance(base.get("rope_scaling"), dict):
            base["rope_scaling"] = RopeScaling(**base["rope_scaling"])
        for key, value in base.items():
            object.__setattr__(self, key, value)
        missing = [k for k in ("vocab_size", "n_layers", "n_heads", "d_model") if getattr(self, k) is None]
        if missing:
            raise ValueError(
                f"missing {', '.join(missing)}: give a preset ({', '.join(MODEL_PRESETS)}), from_hf, or every dimension"
            )
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.max_seq_len is None:
            object.__setattr__(self, "max_seq_len", 2048)
        declared = self.max_position_embeddings or (MODEL_PRESETS[self.preset].get("max_seq_len") if self.preset else 0)
        object.__setattr__(self, "max_position_embeddings", max(declared or 0, self.max_seq_len))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                "choose n_heads that divides d_model"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: each key/value head "
                f"serves the same number of query heads; choose n_kv_heads among {_divisor_list(self.n_heads)}"
            )
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError("rope_scaling needs position='rope'; remove rope_scaling or use rotary positions")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions rotate pairs of a head's dimensions, and d_model / n_heads = "
                             f"{self.head_dim} is odd: choose n_heads so that it is even, or position: learned")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def architecture(self) -> dict:
        """Every resolved key as plain data, without `preset`, `from_hf` or its storage options:
        rebuilds this model with nothing else at hand (the checkpoint manifest carries it)."""
        return self.model_dump(mode="json", exclude={"preset", "from_hf", "storage_options"})

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """Weights of one block's attention: q and o (d x d), k and v (d x kv_dim)."""
        return 2 * self.d_model * self.d_model + 2 * self.d_model * self.kv_dim

    @property
    def mlp_params(self) -> int:
        """Weights of one block's MLP: 3 matrices with SwiGLU, 2 with gelu."""
        return (3 if self.activation == "swiglu" else 2) * self.d_model * self.d_ff


def _divisor_list(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _absolute_path(cls, path: str) -> str:
    """A data path as every process reads it (in its own working directory): absolute (trainer.urls)."""
    return absolute_url(path)


def _absolute_path_if_set(cls, path: str | None) -> str | None:
    return None if not path else absolute_url(path)  # "" as unset: the synthetic source names no file


class MixturePart(_Strict):
    """One prepared dataset of a `data.mixture` and its share of the samples."""

    path: str = Field(..., description="URL of a dataset prepared by `undying data prepare`")
    weight: float = Field(..., gt=0.0, description="relative share of the samples drawn from it")

    _absolute = field_validator("path")(_absolute_path)


class DataConfig(_Strict):
    """Where samples come from. Sample i of global step s is a pure function of (seed, s, i)."""

    source: Literal["synthetic", "text", "tokens"] = Field(
        "synthetic", description="synthetic samples, a UTF-8 text file tokenized as bytes (up to 256 MiB: every "
        "rank holds it whole), or prepared token datasets")
    path: str | None = Field(None, description="source text: fsspec URL or local path of a UTF-8 text file; source "
                             "tokens: the directory URL of a dataset prepared by `undying data prepare`")
    mixture: list[MixturePart] | None = Field(None, description="source tokens: several prepared datasets, each "
                                              "sample drawn from one in proportion to its weight (instead of path)")
    storage_options: dict = Field(default_factory=dict, description="fsspec options for the data URLs (e.g. "
                                  "endpoint_url); credentials go in storage_options_file")
    prefetch_steps: int = Field(4, ge=1, description="steps of this rank's samples made or read ahead by a "
                                "background thread (bounded memory)")
    read_retry_s: float = Field(120.0, ge=0.0, description="how long a remote data read may keep failing "
                                "transiently (throttling, 5xx, timeouts) before the rank gives up; the budget "
                                "renews after each outage; 0: no retry")
    seq_len: int = Field(64, gt=1, description="tokens per training window")
    seed: int = Field(0, description="sample i of global step s is a pure function of (seed, s, i)")
    # Variable lengths exercise padding and token weighting.
    min_len_fraction: float = Field(0.5, gt=0.0, le=1.0, description="synthetic samples have lengths drawn in "
                                    "[min_len_fraction * seq_len, seq_len]; 1.0 gives fixed-length samples")

    _absolute = field_validator("path")(_absolute_path_if_set)

    @field_validator("path", mode="after")
    @classmethod
    def _read_by_the_source(cls, path: str | None, info: ValidationInfo) -> str | None:
        # `source` is declared first. Ignored, the job would train on random tokens in silence.
        if info.data.get("source") == "synthetic" and path:
            raise ValueError(f"{path!r} is read only with source 'text' (a UTF-8 text file) or 'tokens' (a "
                             "dataset prepared by `undying data prepare`): set data.source, or remove data.path "
                             "to train on synthetic samples")
        return path

    @model_validator(mode="after")
    def _path_for_source(self) -> DataConfig:
        if self.source == "text" and not self.path:
            raise ValueError("source 'text' needs data.path: the URL or path of a UTF-8 text file")
        if self.source == "tokens" and bool(self.path) == bool(self.mixture):
            raise ValueError("source 'tokens' needs exactly one of data.path (a prepared dataset's URL) and "
                             "data.mixture (a list of {path, weight})")
        if self.source != "tokens" and self.mixture:
            raise ValueError(f"data.mixture needs source 'tokens', got source {self.source!r}")
        return self

    def token_parts(self) -> list[tuple[MixturePart, str]]:
        """Source tokens' datasets, each with its field for errors (data.path, data.mixture[i].path)."""
        if self.mixture:
            return [(part, f"data.mixture[{i}].path") for i, part in enumerate(self.mixture)]
        return [(MixturePart(path=self.path, weight=1.0), "data.path")]


class EvalConfig(_Strict):
    """Validation loss during training on a held-out prepared dataset (trainer/evaluation.py gives
    the semantics): every `every_steps` steps and after the last one."""

    path: str = Field(..., description="URL of a held-out dataset prepared by `undying data prepare`")
    every_steps: int = Field(..., gt=0, description="evaluate every this many steps (and after the last one)")
    windows: int = Field(64, gt=0, description="windows of the dataset each evaluation reads")
    seq_len: int | None = Field(None, gt=0, description="tokens per evaluation window; unset: data.seq_len")
    storage_options: dict = Field(default_factory=dict, description="fsspec options for path; empty: "
                                  "data.storage_options")

    _absolute = field_validator("path")(_absolute_path)

    def due(self, completed: int, last_step: int) -> bool:
        """Whether the model after `completed` steps is validated: every `every_steps`, and after the last."""
        return completed > 0 and (completed % self.every_steps == 0 or completed == last_step)


class TrainConfig(_Strict):
    """Optimisation: how many steps, the batch, the optimizer and its schedule, numerics."""

    steps: int = Field(..., gt=0, lt=10**9, description="optimizer steps the job trains for")  # (9-digit step dirs)
    global_batch: int = Field(..., gt=0, description="samples per optimizer step, over all ranks")
    micro_batch: int = Field(1, gt=0, description="samples per forward/backward on one rank")
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate, reached after warmup")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="the cosine decay ends at lr * min_lr_ratio")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps from 0 to lr")
    weight_decay: float = Field(0.1, ge=0.0, description="matrices' weight decay: AdamW's decoupled, sgd's L2")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam's (beta1, beta2), each in [0, 1)")
    grad_clip: float | None = Field(1.0, gt=0.0, description="clip the global gradient norm to this (null: no "
                                    "clipping)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="the optimizer")
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="compute dtype (fp16 with a loss scaler)")
    seed: int = Field(0, description="seed of the initial weights")
    deterministic: bool = Field(True, description="deterministic kernels: the same seed gives the same losses")
    compile: bool = Field(False, description="torch.compile each transformer block (inductor); the first steps "
                          "pay the compile time")

    @field_validator("warmup_steps", mode="after")
    @classmethod
    def _warmup_within_the_run(cls, warmup: int, info: ValidationInfo) -> int:
        # Typically a warmup copied from a long run into a short one: lr would never reach its peak.
        steps = info.data.get("steps")  # declared first; absent when it failed its own check
        if steps is not None and warmup > steps:
            raise ValueError(f"{warmup} exceeds train.steps {steps}: the learning rate would never reach "
                             f"train.lr; lower it (e.g. {max(1, steps // 10)}, a tenth of the run)")
        return warmup

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # What torch's Adam refuses, refused here, before a rank builds its optimizer.
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"{list(betas)}: each of (beta1, beta2) must be in [0, 1), e.g. [0.9, 0.95]")
        return betas


class ParallelConfig(_Strict):
    """The 3D layout: world size = dp * tp * pp ranks."""

    dp: int = Field(1, gt=0, description="data-parallel replicas")
    dp_replicate: int = Field(1, gt=0, description="HSDP: the dp ranks form this many replicas, each sharding the "
                              "state over dp / dp_replicate ranks (zero 2 or 3; gradients all-reduced across "
                              "replicas); 1: shard over all dp ranks")
    tp: int = Field(1, gt=0, description="tensor-parallel ranks per replica (split heads, MLP width, vocabulary)")
    pp: int = Field(1, gt=0, description="pipeline stages per replica")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage over dp: 1 shards optimizer state, 2 gradients "
                                      "too, 3 parameters too")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream"] = Field(
        "1f1b", description="pipeline schedule (pp > 1); 'pipedream' (asynchronous) is refused by the engine: "
                            "use trainer.pipedream.PipeDream2BW directly")
    virtual_stages: int | None = Field(None, gt=0, description="model chunks per pipeline rank: interleaved needs "
                                       ">= 2, zero-bubble (V shape) uses 2; unset: the schedule's default")
    ddp_bucket_mb: float = Field(25.0, gt=0.0, description="gradient all-reduce bucket size (MB)")
    recompute: Literal["none", "selective", "block"] = Field(
        "none", description="activation recomputation: selective keeps matmul outputs and recomputes element-wise "
        "ops and attention internals; block keeps only each block's input")
    sequence_parallel: bool = Field(True, description="Megatron sequence parallelism for norms and dropout when "
                                    "tp > 1 (ignored when tp = 1)")
    mode: Literal["collective", "ps"] = Field("collective", description="collective: the ranks all-reduce "
                                              "gradients (DDP / ZeRO); ps: parameter server, dp workers push "
                                              "gradients to and pull parameters from server actors")
    servers: int = Field(1, gt=0, description="ps: server actors the model's state is partitioned over, by bytes")
    consistency: Literal["bsp", "ssp", "asp"] = Field("bsp", description="ps: bsp waits for every worker's "
                                                      "gradient each step (equals collective dp), ssp lets a "
                                                      "worker run at most `staleness` steps ahead of the "
                                                      "slowest, asp has no bound")
    staleness: int | None = Field(None, ge=0, description="ps with consistency ssp: how many steps a worker may "
                                  "run ahead of the slowest one")

    @field_validator("virtual_stages", mode="after")
    @classmethod
    def _virtual_stages_need_a_pipeline(cls, virtual: int | None, info: ValidationInfo) -> int | None:
        if info.data.get("pp") == 1 and virtual not in (None, 1):  # `pp` is declared first; else ignored in silence
            raise ValueError(f"{virtual} with parallel.pp 1: virtual stages are model chunks per pipeline rank; "
                             "remove it, or set parallel.pp above 1")
        return virtual

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """Ranks one replica shards the state over (HSDP); dp when dp_replicate is 1."""
        return self.dp // self.dp_replicate

    @property
    def dp_unit(self) -> int:
        """dp indices that elastic shrinking and growing drop or add together: one HSDP replica
        (dp / dp_replicate), else 1."""
        return self.dp_shard if self.dp_replicate > 1 else 1

    def with_dp(self, dp: int) -> ParallelConfig:
        """This layout at another (elastic) dp: an HSDP layout keeps its shard size and changes
        its replica count, so dp must be a multiple of it (the controller's scaling policy)."""
        if self.dp_replicate == 1:
            return self.model_copy(update={"dp": dp})
        assert dp % self.dp_shard == 0, f"dp={dp} is not whole replicas of {self.dp_shard} ranks"
        return self.model_copy(update={"dp": dp, "dp_replicate": dp // self.dp_shard})
