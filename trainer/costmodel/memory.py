"""Peak memory per rank as four ledgers (docs/design.md section 1):

    M_peak = M_state + M_activation + M_collective + M_transient

Bytes, for one rank of one pipeline stage; `ledgers()` reports the most loaded stage. The
totals approximate what torch's caching allocator reserves (`max_memory_reserved`): the
CUDA context and NCCL's own buffers live outside it and are `runtime_reserve_bytes`, which
the planner subtracts from the device's capacity instead.

State (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, with W, G, O the bytes of weights,
gradients and optimizer state on the rank and D = dp, or under HSDP the ranks of one replica,
dp / dp_replicate: each replica holds a whole sharded copy), as the engine holds it between its
gradient reduction and its optimizer step:
    stage 0  W + G + O      stage 1  W + G + O/D      stage 2  (W + G + O)/D      stage 3  (W + G + O)/D
Stage 2 is FSDP2 with reshard_after_forward=False (trainer/data_parallel.py): the weights are
sharded at rest like stage 3's, not replicated as in the paper's stage 2; what differs is that
every block's gathered weights stay from its forward to its backward, which M_collective
counts. A pipeline rank's W, G, O are those of its own chunks (layout.stage_params: the
FLOP-balanced split, interleaved and V-shaped placements, the tied embedding's copy). FSDP2
pads each shard to ceil(rows / D) rows, which /D leaves out (under 2 % for the layouts
tested). Gradients stay sharded while they accumulate over microbatches: the engine
reduce-scatters every microbatch's into the sharded gradient (trainer.data_parallel.gradient_sync).
Inside a pipeline they cannot: torch's pipeline stages turn FSDP2's gradient sync off for
every backward and reduce once after the schedule, so until then the stage holds its whole
unsharded fp32 gradient: stages 2 and 3 with pp > 1 hold W/D + G + O/D at their peak, and
the weights of every block stay gathered (M_collective). A rank of several chunks
(interleaved, zero-bubble) reduces each chunk after that chunk's last backward; with fewer
than 2 pp microbatches one chunk can be reduced before another's first backward, and the
rank holds less (pp 2, 2 microbatches: 8 to 14 % less state; 4 microbatches: as booked).
Measured against the bytes every rank of every layout of the engine's parity matrix holds
at its peak, after every microbatch's backward, in tests/dist/test_state_ledger.py.
Weights stay fp32 in every precision: bf16/fp16 run under autocast, as the engine does, or
FSDP2's MixedPrecisionPolicy, and both keep the fp32 parameters as the master copy and make
low-precision copies per use (counted below). So per parameter W = 4, G = 4 (fp32 grads),
O = 8 for AdamW (exp_avg, exp_avg_sq) or 4 for SGD (momentum), and fp32 AdamW on dp=1 is
16 bytes per parameter. `pipedream` keeps one stashed weight version more (PipeDream-2BW).

Activation: bytes one layer saves for backward per token (count of the tensors autograd keeps
in trainer.model's Block, in the manner of Korthikanti et al. 2022, arXiv:2205.05198, sec 4),
times layers, times the microbatches in flight on the stage, plus the LM head's logits on the
last stage. See `layer_activation_bytes`; for an unsharded model on CPU the count is exact
(tests/unit/test_costmodel.py compares it with the tensors autograd saves).

Collective: DDP's gradient buckets (a flat copy of every gradient: the engine leaves
`gradient_as_bucket_view` off), the unsharded copies FSDP all-gathers (ZeRO-3: the layer in
use plus the prefetched next; ZeRO-2: every layer's, held from its forward to its backward;
both in the compute dtype, which FSDP2's MixedPrecisionPolicy gathers) and their
reduce-scatter input (one block's fp32 gradients), and the pipeline's send/receive buffers.

Transient (an estimate, not a count): GEMM workspace, the optimizer step's temporaries where
they exceed the activations they reuse, and a fragmentation allowance of the caching
allocator on the memory that churns (activations and collective buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.costmodel.layout import Layout, StageParams, Workload, stage_params

RESIDUAL_BYTES = 4  # the residual stream is fp32: fp32 embeddings plus autocast outputs upcast
LOW_PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# An allowance, not a measurement: reserved-but-unallocated blocks of the caching allocator,
# as a fraction of the memory that is allocated and freed every step. To be calibrated
# against max_memory_reserved on a GPU (the prediction should be within 15 % of it; python -m bench.gpu_check).
FRAGMENTATION = 0.10
GEMM_WORKSPACE_BYTES = 32 << 20  # cuBLAS with CUBLAS_WORKSPACE_CONFIG=:4096:8 (engine, deterministic)
CUDA_CONTEXT_BYTES = 512 << 20  # CUDA context and kernels, outside the caching allocator
NCCL_COMMUNICATOR_BYTES = 256 << 20  # NCCL channel buffers per communicator (estimate)
CPU_PROCESS_BYTES = 512 << 20  # a Python process with torch imported, per rank
RNG_STATE_BYTES = 5056  # torch's CPU generator state (Mersenne Twister), kept by each checkpointed block


@dataclass(frozen=True)
class Ledgers:
    """The four ledgers of one rank, in bytes; `stage` is the pipeline stage they describe."""

    state: int
    activation: int
    collective: int
    transient: int
    stage: int = 0

    @property
    def total(self) -> int:
        return self.state + self.activation + self.collective + self.transient

    def to_json(self) -> dict:
        return {"state": self.state, "activation": self.activation, "collective": self.collective,
                "transient": self.transient, "total": self.total, "stage": self.stage}


def state_bytes_per_param(optimizer: str) -> tuple[int, int, int]:
    """(W, G, O) bytes per parameter; the same in every precision (module docstring)."""
    return 4, 4, (8 if optimizer == "adamw" else 4)


def zero_state_bytes(weights: float, grads: float, optim: float, zero: int, dp: int) -> float:
    """Static state per rank for ZeRO stage `zero` over `dp` ranks (module docstring)."""
    if zero == 0:
        return weights + grads + optim
    if zero == 1:
        return weights + grads + optim / dp
    if zero in (2, 3):
        return (weights + grads + optim) / dp
    raise ValueError(f"ZeRO stage {zero} does not exist; stages are 0, 1, 2, 3")


def m_state(work: Workload, layout: Layout, params: StageParams) -> int:
    w, g, o = (n * params.total for n in state_bytes_per_param(work.optimizer))
    state = zero_state_bytes(w, g, o, layout.zero, layout.dp_shard)
    if layout.zero >= 2 and layout.dp > 1 and layout.pp > 1:
        state += g - g / layout.dp_shard  # a pipeline stage's gradients, unsharded until the step's end
    if layout.schedule == "pipedream" and layout.pp > 1:
        state += w  # the stashed weight version the in-flight backwards use
    return round(state)


def in_flight_microbatches(schedule: str, p: int, m: int, stage: int, v: int = 1) -> float:
    """Microbatches whose activations stage `stage` of `p` holds at its peak, in units of the
    rank's whole set of layers.

    No pipeline: 1 (each microbatch's backward runs before the next forward). GPipe: all m
    forwards run before the first backward (Huang et al. 2019). 1F1B: stage s starts its
    first backward after p - s forwards (Narayanan et al. 2019, PipeDream-Flush); ZB-V and
    PipeDream-2BW keep the same peak (Qi et al. 2024; Narayanan et al. 2021). Interleaved
    1F1B with v chunks per rank: Megatron-LM's warm-up, 2(p - s - 1) + (v - 1)p chunk
    forwards before the first backward, plus the one in progress, each chunk 1/v of the
    rank's layers; on stage 0 that is p + (p - 1)/v (Korthikanti et al. 2022, sec 4.2.3).
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), (2 * (p - stage - 1) + (v - 1) * p + 1) / v)
    return float(min(m, p - stage))


def _norm_bytes_per_token(work: Workload, device_kind: str) -> float:
    """What one norm saves per token: its fp32 input and statistics (LayerNorm mean and rstd,
    RMSNorm rstd). CUDA runs RMSNorm as one fused kernel; the CPU runs torch's composite,
    which also saves the normalized input for the gain's gradient."""
    h, rms = work.model.d_model, work.model.norm == "rmsnorm"
    extra = RESIDUAL_BYTES * h if rms and device_kind == "cpu" else 0
    return RESIDUAL_BYTES * h + extra + 4 * (1 if rms else 2)


def layer_activation_bytes(work: Workload, layout: Layout, tokens: int, recompute: str,
                           device_kind: str = "gpu") -> int:
    """Bytes one transformer block saves for backward for `tokens` tokens on one tp rank.

    Per token, with h = d_model, f = d_ff, e the compute element size, t = tp, t_sp = t
    under sequence parallelism (else 1), n the norm's bytes (`_norm_bytes_per_token`):
      none       2n/t_sp       the two norms (inputs sequence-sharded under SP)
                 + e*c*h       the inputs of the projections that read a norm's output. DTensor
                               saves the all-gathered tensor (Megatron re-gathers in backward
                               instead). c = 2 in fp32 (shared by q, k, v and by the MLP's first
                               projections); under autocast each projection casts its own
                               copy: c = 3 + 2 (swiglu) or 3 + 1 (gelu)
                 + e*4h/t      q and k after RoPE, v, attention output (o_proj's input is a
                               view of it)
                 + e*k*f/t     MLP intermediates: swiglu gate, silu(gate), up, product (k=4);
                               gelu up, gelu(up) (k=2)
                 + 4*heads/t   the attention's log-sum-exp (flash / memory-efficient SDPA)
      selective  4h/t_sp       the block's fp32 input
                 + e*(3h + j*f)/t   every matmul output (trainer/recompute.py's policy): q, k, v
                               and the MLP's j = 2 (swiglu) or 1 first projections, split over tp
                 + 2e*h        o_proj's and down_proj's local outputs: full width, the partial
                               sums before their reduction
                 + 2e*h/t_sp   the outputs of those reductions (when t > 1): reduce-scatter
                               under SP, all-reduce without; saved so backward repeats no reduction
                 the norms, attention core, activation functions and dropout are recomputed
      block      4h/t_sp: the block's fp32 input only; the block is re-run in backward
    plus, without recomputation, 1-byte dropout masks on the two residual branches when
    dropout > 0; with it, the CPU RNG state each checkpointed block keeps to replay dropout
    (RNG_STATE_BYTES, per block, not per token). Measured against autograd's saved tensors
    (none) and the allocator's net allocations (selective, block) in tests/unit/test_costmodel.py.
    """
    m, h, f = work.model, work.model.d_model, work.model.d_ff
    t = layout.tp
    t_sp = t if layout.sequence_parallel and t > 1 else 1
    e = LOW_PRECISION_BYTES[work.precision]
    swiglu = m.activation == "swiglu"
    norms = 2 * _norm_bytes_per_token(work, device_kind) / t_sp
    masks = 2 * h / t_sp if m.dropout > 0 else 0
    if recompute == "block":
        per_token = RESIDUAL_BYTES * h / t_sp
    elif recompute == "selective":
        reductions = 2 * e * h / t_sp if t > 1 else 0
        per_token = (RESIDUAL_BYTES * h / t_sp + e * (3 * h + (2 if swiglu else 1) * f) / t
                     + 2 * e * h + reductions)
    elif recompute == "none":
        copies = 2 if work.precision == "fp32" else 3 + (2 if swiglu else 1)
        per_token = (norms + e * copies * h + e * (4 * h + (4 if swiglu else 2) * f) / t
                     + 4 * m.n_heads / t + masks)
        return round(tokens * per_token)
    else:
        raise ValueError(f"recompute {recompute!r} is not one of none, selective, block")
    return round(tokens * per_token) + RNG_STATE_BYTES


def _head_activation_bytes(work: Workload, layout: Layout, tokens: int, device_kind: str) -> int:
    """The last stage's extra per token: the final norm, the LM head's input, the logits (kept
    alive by the caller), the fp32 log-softmax output, the int64 targets, and the logits'
    fp32 gradient when backward starts (the fp32 upcast of bf16 logits is freed after the
    forward: log-softmax saves its output, not its input). Vocab-parallel (loss_parallel)
    splits the vocabulary over tp."""
    h, e = work.model.d_model, LOW_PRECISION_BYTES[work.precision]
    vocab = -(-work.model.vocab_size // layout.tp)
    per_token = _norm_bytes_per_token(work, device_kind) + e * h + vocab * (e + 4 + 4) + 8
    return round(tokens * per_token)


def m_activation(work: Workload, layout: Layout, params: StageParams, device_kind: str = "gpu") -> int:
    tokens = layout.micro_batch * work.seq_len
    m = layout.microbatches(work.global_batch)
    held = in_flight_microbatches(layout.schedule, layout.pp, m, params.stage, layout.virtual_stages)
    per_layer = layer_activation_bytes(work, layout, tokens, layout.recompute, device_kind)
    per_microbatch = params.layers * per_layer
    if params.last:
        per_microbatch += _head_activation_bytes(work, layout, tokens, device_kind)
    if work.precision != "fp32" and layout.zero < 2:
        # autocast's low-precision weight copies are saved for backward with each microbatch
        # (FSDP2, ZeRO 2 and 3, gathers low-precision weights instead: M_collective); a
        # recomputed block casts its weights again in backward, so only the head's copy stays
        copied = params.matmul_params
        if layout.recompute != "none":
            head = -(-work.model.vocab_size // layout.tp) * work.model.d_model if params.last else 0
            copied = head
        per_microbatch += LOW_PRECISION_BYTES[work.precision] * copied
    total = held * per_microbatch
    if layout.recompute != "none":
        # the layer being recomputed holds its full activations during its backward
        total += layer_activation_bytes(work, layout, tokens, "none", device_kind)
    return round(total)


def m_collective(work: Workload, layout: Layout, params: StageParams) -> int:
    """Communication memory of the rank (module docstring); one FSDP unit is one block, or
    the (vocab-sharded) embedding / head where the stage holds it."""
    e = LOW_PRECISION_BYTES[work.precision]
    grad_bytes = 4 * params.total
    unit = params.block_params // max(params.layers, 1)
    if params.other_params:
        unit = max(unit, params.other_params)
    out = 0
    if layout.dp > 1 and layout.zero in (0, 1):
        out += grad_bytes
    elif layout.dp > 1 and (layout.zero == 2 or layout.pp > 1):
        # inside a pipeline ZeRO-3 too keeps every block gathered from its backward to the step's end
        out += e * params.total + 4 * unit
    elif layout.dp > 1 and layout.zero == 3:
        out += 2 * e * unit + 4 * unit
    if layout.pp > 1:
        t_sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
        out += 4 * layout.micro_batch * work.seq_len * work.model.d_model // t_sp * e
    return round(out)


def m_transient(work: Workload, layout: Layout, params: StageParams, activation: int, collective: int,
                device_kind: str) -> int:
    """GEMM workspace + optimizer temporaries beyond the activations (freed before the step)
    + fragmentation. GPU AdamW runs `foreach`: one moment-sized temporary (sqrt(v)) over the
    rank's optimizer shard; CPU AdamW runs per tensor: two temporaries of the largest one."""
    opt_params = params.total / layout.dp_shard if layout.zero >= 1 else params.total
    largest = max(work.model.vocab_size * work.model.d_model // layout.tp,
                  work.model.d_model * work.model.d_ff // layout.tp)
    if work.optimizer != "adamw":
        optimizer_temp = 0.0
    elif device_kind == "gpu":
        optimizer_temp = 4 * opt_params
    else:
        optimizer_temp = 2 * 4 * largest
    workspace = GEMM_WORKSPACE_BYTES if device_kind == "gpu" else 0
    churn = activation + collective
    return round(workspace + max(0.0, optimizer_temp - activation) + FRAGMENTATION * churn)


def stage_ledgers(work: Workload, layout: Layout, stage: int, device_kind: str = "gpu") -> Ledgers:
    params = stage_params(work.model, layout, stage, work.seq_len)
    state = m_state(work, layout, params)
    activation = m_activation(work, layout, params, device_kind)
    collective = m_collective(work, layout, params)
    transient = m_transient(work, layout, params, activation, collective, device_kind)
    return Ledgers(state, activation, collective, transient, stage)


def ledgers(work: Workload, layout: Layout, device_kind: str = "gpu") -> Ledgers:
    """The ledgers of the rank with the largest total: the one that runs out of memory first."""
    per_stage = (stage_ledgers(work, layout, s, device_kind) for s in range(layout.pp))
    return max(per_stage, key=lambda ledger: ledger.total)


def runtime_reserve_bytes(layout: Layout, device_kind: str) -> int:
    """Device memory used outside the caching allocator: on a GPU the CUDA context plus
    NCCL's buffers per communicator (one per parallel dimension of degree > 1); on a CPU the
    process itself. Estimates, like M_transient."""
    if device_kind == "cpu":
        return CPU_PROCESS_BYTES
    # HSDP's replicate and shard groups are one communicator each, beside the whole dp group
    communicators = sum(1 for degree in (layout.dp, layout.tp, layout.pp) if degree > 1) + 2 * (layout.dp_replicate > 1)
    return CUDA_CONTEXT_BYTES + communicators * NCCL_COMMUNICATOR_BYTES
