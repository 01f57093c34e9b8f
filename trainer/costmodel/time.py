"""Step time from first principles (docs/design.md section 1):

    T_step >= max(F/F_peak, Q_hbm/B_hbm, Q_net/B_net) + T_bubble + T_unhidden_io

F is the FLOPs of the slowest pipeline stage's rank (`trainer.model.flops_per_token`'s
count, split by stage and tp, plus recomputation), Q_hbm its memory traffic, Q_net its
data-parallel traffic. Data-parallel collectives overlap with compute (DDP buckets during
backward, FSDP prefetch), so they sit inside the max. Tensor-parallel all-reduces and
pipeline sends are on the critical path (each layer waits for its input), so they add:
that term (`exposed_comm_s`) makes the bound tighter without making it false. The bubble
is the time a stage must wait for the stages before it (`predict`). Every term counts only
what the engine must do (the data-parallel collectives as trainer/data_parallel.py runs
them, once per step where it reduces once per step), so the sum stays a lower bound.

Collective costs (ring algorithms, alpha = one step's latency, B = one direction's bandwidth):
    all-reduce                       2(D-1) alpha + 2(D-1)/D * S/B
    all-gather, reduce-scatter       (D-1) alpha + (D-1)/D * S/B
    point-to-point                   alpha + S/B
Links follow the rank mapping (layout.py): a group whose ranks span more than one node
uses the inter-node link, else NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.costmodel.hardware import Hardware
from trainer.costmodel.layout import Layout, StageParams, Workload, group_stride, stage_params
from trainer.costmodel.memory import LOW_PRECISION_BYTES, Ledgers, layer_activation_bytes, ledgers
from trainer.model import flops_per_token


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step with p stages and m microbatches.

    GPipe and 1F1B: (p-1)/(m+p-1) (Huang et al. 2019). Interleaved with v chunks per rank:
    the p-1 idle slots shrink to (p-1)/v (Narayanan et al. 2021, sec 2.2). Zero-bubble: the
    ZB-H1 schedule's, a third of 1F1B's idle time when forward, input-gradient and
    weight-gradient passes take equal time (Qi et al. 2024, arXiv:2401.10241, sec 3); an
    estimate, not a bound: ZB-V can do better, so `predict` charges zero-bubble no bubble.
    PipeDream (asynchronous) never flushes: 0.
    """
    if p <= 1 or schedule == "pipedream":
        return 0.0
    idle = float(p - 1)
    if schedule == "interleaved":
        idle /= v
    elif schedule == "zero-bubble":
        idle /= 3
    return idle / (m + idle)


def ring_allreduce_seconds(nbytes: float, d: int, alpha: float, bandwidth: float) -> float:
    """2(D-1) alpha + 2(D-1)/D * S/B; each rank sends and receives 2(D-1)/D * S bytes."""
    if d <= 1:
        return 0.0
    return 2 * (d - 1) * alpha + 2 * (d - 1) / d * nbytes / bandwidth


def ring_allgather_seconds(nbytes: float, d: int, alpha: float, bandwidth: float) -> float:
    """(D-1) alpha + (D-1)/D * S/B, S the gathered (or the reduced, unscattered) size; also
    reduce-scatter. An all-reduce is one of each."""
    if d <= 1:
        return 0.0
    return (d - 1) * alpha + (d - 1) / d * nbytes / bandwidth


def group_link(hw: Hardware, layout: Layout, dim: str) -> tuple[float, float]:
    """(alpha, bandwidth) of the `dim` group's ring: inter-node once the group spans nodes."""
    degree = getattr(layout, dim)
    span = group_stride(layout, dim) * degree
    if span > hw.devices_per_node:
        return hw.inter_alpha, hw.inter_bandwidth
    return hw.intra_alpha, hw.intra_bandwidth


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one layout. Seconds; `mfu` in [0, 1] (model FLOPs, without recomputation)."""

    step_s: float
    compute_s: float
    hbm_s: float
    comm_s: float  # all network time of the rank: overlapped data-parallel plus exposed
    exposed_comm_s: float  # the part on the critical path (tensor-parallel, pipeline sends)
    bubble_s: float
    io_s: float
    mfu: float
    tokens_per_s: float
    memory: Ledgers

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "hbm_s": self.hbm_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s, "bubble_s": self.bubble_s,
                "io_s": self.io_s, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
                "memory": self.memory.to_json()}


def rank_flops_per_token(work: Workload, layout: Layout, params: StageParams) -> float:
    """Training FLOPs per token of one tp rank of a stage: 6 per matmul weight, 12 L h s for
    attention (PaLM's count, as `flops_per_token`), plus recomputation: `selective` re-runs
    the attention core forward (4 L h s), `block` the whole forward (2 N_blocks + 4 L h s)."""
    h, s, t = work.model.d_model, work.seq_len, layout.tp
    attention_fwd = 4 * params.layers * h * s / t
    flops = 6 * params.matmul_params + 3 * attention_fwd
    if layout.recompute == "selective":
        flops += attention_fwd
    elif layout.recompute == "block":
        block_matmul = params.block_params - 2 * h * params.layers  # all but the norm gains
        flops += 2 * block_matmul + attention_fwd
    return flops


def _dp_seconds(work: Workload, layout: Layout, hw: Hardware, params: StageParams, m: int) -> float:
    """Data-parallel traffic per step, as the engine runs it (trainer/data_parallel.py).

    ZeRO 0 all-reduces the fp32 gradients once per step, in the last microbatch's backward;
    ZeRO 1 adds the all-gather of the updated weights. ZeRO 2/3 (FSDP2) reduce-scatter the
    gradients in fp32 (the engine's reduce_dtype) `fsdp_reductions` times per step and
    all-gather weights in the compute dtype `fsdp_gathers` times.
    """
    alpha, bw = group_link(hw, layout, "dp")
    d = layout.dp
    grads = 4 * params.total
    if layout.zero == 0:
        return ring_allreduce_seconds(grads, d, alpha, bw)
    if layout.zero == 1:
        return ring_allreduce_seconds(grads, d, alpha, bw) + ring_allgather_seconds(4 * params.total, d, alpha, bw)
    low = LOW_PRECISION_BYTES[work.precision]
    block_gathers, other_gathers = fsdp_gathers(layout, m)
    scattered = fsdp_reductions(layout, m) * grads  # each reduce-scatter takes the stage's gradients
    gathered = low * (block_gathers * params.block_params + other_gathers * params.other_params)
    if layout.dp_replicate == 1:
        return ring_allgather_seconds(gathered, d, alpha, bw) + ring_allgather_seconds(scattered, d, alpha, bw)
    # HSDP: gathers and the reduce-scatter stay inside a replica's shard group; the replicas
    # all-reduce only their gradient shard (1/dp_shard of it), over the replicate group's link.
    s, (alpha, bw) = layout.dp_shard, group_link(hw, layout, "dp_shard")
    across = ring_allreduce_seconds(grads / s, layout.dp_replicate, *group_link(hw, layout, "dp_replicate"))
    return ring_allgather_seconds(gathered, s, alpha, bw) + ring_allgather_seconds(scattered, s, alpha, bw) + across


def fsdp_reductions(layout: Layout, m: int) -> int:
    """Gradient reduce-scatters per step under FSDP2 with m microbatches.

    Without a pipeline the engine reduce-scatters every microbatch's gradients into the
    sharded gradient (`gradient_sync`: ZeRO-2 keeps gradients sharded while they accumulate).
    torch's pipeline stages accumulate unsharded gradients and reduce once per step (the
    memory cost is booked in trainer.costmodel.memory.m_state).
    """
    return m if layout.pp == 1 else 1


def fsdp_gathers(layout: Layout, m: int) -> tuple[int, int]:
    """(blocks', the rest's) weight all-gathers per step under FSDP2 with m microbatches: the
    fewest the engine can do, so that the bound stays one.

    Without a pipeline every microbatch gathers in its forward and reshards after its
    backward; ZeRO-3 also reshards after the forward and regathers for the backward, except
    the root unit (embedding, final norm, head), which FSDP2 never reshards after forward.
    Inside a pipeline stage torch keeps the weights gathered between microbatches until the
    last backward: ZeRO 2 gathers once per step; ZeRO 3 still regathers the blocks for each
    microbatch's backward (m at least) and the root once.
    """
    if layout.pp > 1:
        return (1, 1) if layout.zero == 2 else (m, 1)
    return (m, m) if layout.zero == 2 else (2 * m, m)


def _exposed_seconds(work: Workload, layout: Layout, hw: Hardware, params: StageParams, m: int) -> float:
    """Tensor-parallel all-reduces (2 per layer forward, 2 backward, 2 more when the block is
    recomputed; one each for the vocab-parallel embedding and head) and pipeline sends."""
    tokens, e = layout.micro_batch * work.seq_len, LOW_PRECISION_BYTES[work.precision]
    activation = tokens * work.model.d_model * e
    out = 0.0
    if layout.tp > 1:
        per_layer = 6 if layout.recompute == "block" else 4
        count = params.layers * per_layer + params.first + params.last
        out += m * count * ring_allreduce_seconds(activation, layout.tp, *group_link(hw, layout, "tp"))
    if layout.pp > 1:
        alpha, bw = group_link(hw, layout, "pp")
        t_sp = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
        out += m * layout.virtual_stages * 2 * (alpha + activation / t_sp / bw)
    return out


def _hbm_bytes(work: Workload, layout: Layout, params: StageParams, m: int, device_kind: str) -> float:
    """Lower bound of memory traffic per step: the matmul weights read twice per microbatch
    (forward, input gradient; the weight gradient reads activations, not weights) and once
    more when the block is recomputed, saved activations written and read once, fp32
    gradients written by the first microbatch and read and written by each later one, and
    the optimizer reading W, G, O and writing W, O."""
    e = LOW_PRECISION_BYTES[work.precision]
    tokens = layout.micro_batch * work.seq_len
    saved = params.layers * layer_activation_bytes(work, layout, tokens, layout.recompute, device_kind)
    reads = 3 if layout.recompute == "block" else 2
    per_micro = reads * e * params.matmul_params + 2 * saved
    grads = (2 * m - 1) * 4 * params.total
    optim_bytes = 8 if work.optimizer == "adamw" else 4
    opt_params = params.total / layout.dp_shard if layout.zero >= 1 else params.total
    return m * per_micro + grads + opt_params * (2 * 4 + 4 + 2 * optim_bytes)


def pipeline_bound(busy: list[float], work: list[float], wait: float) -> tuple[int, float]:
    """(k, bubble) of the pipeline rank k whose busy_k + wait * sum_{i<k} work_i is largest.

    `busy` is each rank's time per step, `work` the part of it a microbatch carries through
    the pipeline (compute and pipeline sends), `wait` the share of upstream work a rank waits
    for: 1/m for GPipe and 1F1B (`predict`).
    """
    best, upstream = (0, 0.0), 0.0
    for k, (b, w) in enumerate(zip(busy, work, strict=True)):
        if b + upstream * wait > busy[best[0]] + best[1]:
            best = (k, upstream * wait)
        upstream += w
    return best


def predict(work: Workload, layout: Layout, hw: Hardware, io_s: float = 0.0) -> Prediction:
    """Predicted step of `layout` on `hw` (see the module docstring): a lower bound.

    The bubble, stage by stage: pipeline rank k starts only after the first microbatch's
    forward crossed ranks 0..k-1, and its last backward must still cross them, so a GPipe or
    1F1B step takes at least busy_k + sum_{i<k} t_i (t_i a microbatch's compute on rank i),
    for every k; the step is the largest. With equal stages the last one gives the familiar
    (p-1) t; stages the engine cut unevenly give what they give (p - 1 copies of the slowest
    stage would not be a bound). Interleaving divides the wait by v (`bubble_fraction`);
    zero-bubble is charged none, since ZB-V can remove it when its passes balance.
    """
    m = layout.microbatches(work.global_batch)
    tokens_per_rank = layout.micro_batch * work.seq_len * m
    # ranks of a CPU job share the host's cores (and memory bandwidth); a GPU is one rank's own
    share = hw.host_share(layout.world)
    peak, hbm_bandwidth = hw.peak(work.precision) * share, hw.hbm_bandwidth * share
    f = 0.0 if layout.schedule == "zero-bubble" else bubble_fraction(layout.schedule, layout.pp, m,
                                                                      layout.virtual_stages)
    # the wait for one stage's microbatch, per microbatch of compute: idle / (p - 1) / m
    wait = f / (1 - f) / (layout.pp - 1) if layout.pp > 1 else 0.0
    stages = []
    for stage in range(layout.pp):
        params = stage_params(work.model, layout, stage, work.seq_len)
        compute = tokens_per_rank * rank_flops_per_token(work, layout, params) / peak
        hbm = _hbm_bytes(work, layout, params, m, hw.kind) / hbm_bandwidth
        dp = _dp_seconds(work, layout, hw, params, m)
        exposed = _exposed_seconds(work, layout, hw, params, m)
        stages.append((max(compute, hbm, dp) + exposed, compute, hbm, dp, exposed))
    worst, bubble = pipeline_bound([s[0] for s in stages], [s[1] + s[4] for s in stages], wait)
    busy, compute, hbm, dp, exposed = stages[worst]
    step = busy + bubble + io_s
    model_flops = flops_per_token(work.model, work.seq_len) * work.tokens_per_step
    return Prediction(step_s=step, compute_s=compute, hbm_s=hbm, comm_s=dp + exposed, exposed_comm_s=exposed,
                      bubble_s=bubble, io_s=io_s, mfu=model_flops / (step * layout.world * peak),
                      tokens_per_s=work.tokens_per_step / step, memory=ledgers(work, layout, hw.kind))


def predict_step(spec_like: Any, hardware: Hardware, n_gpus: int, layout: Layout | None = None,
                 io_s: float = 0.0) -> Prediction:
    """Predict a spec's step on `n_gpus` devices of `hardware`.

    `spec_like` is a JobSpec or any object with its `model`, `data`, `train` sections (and
    `parallel` when `layout` is not given). `io_s` is the unhidden I/O per step (checkpoint
    saves, input stalls) that the caller measured or budgets.
    """
    layout = layout or Layout.from_spec(spec_like)
    if layout.world != n_gpus:
        raise ValueError(f"layout {layout.label()} uses {layout.world} devices, not n_gpus={n_gpus}")
    return predict(Workload.from_spec(spec_like), layout, hardware, io_s)
