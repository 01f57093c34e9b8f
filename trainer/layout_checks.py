"""Construction-time checks of the layout an engine is asked to run (docs/design.md invariant 7).

Called first thing by `Engine.__init__`, before any collective, so a bad combination fails on
every rank with the same message, naming the field and the fix. The job spec runs the pipeline
checks too (`check_pipeline`), so a job asking for such a layout is refused before any rank starts.

Pipeline layouts refused (pp > 1), and why:
  * schedule 'pipedream': PipeDream-2BW trains on one-step-stale weights, without clipping or
    data parallelism; it is a different training rule, run by trainer.pipedream.PipeDream2BW.
  * zero-bubble with dp > 1 and zero 0/1 (DDP-wrapped stages: torch 2.13 crashes in the split
    backward) or zero 3 (FSDP2 reshard_after_forward=True: silently wrong gradients). zero 2
    runs it; running zero 3 as zero 2 would hide a memory difference, so it is refused.
  * virtual stages the schedule cannot use (gpipe/1f1b: 1; interleaved: >= 2; zero-bubble: 2),
    fewer layers than chunks, 1F1B with fewer microbatches than pp, and interleaved 1F1B
    whose microbatches do not split into rounds of pp (torch's requirement).
"""

from __future__ import annotations

import torch.distributed as dist

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import microbatches_per_rank
from trainer.tensor_parallel import check_tensor_parallel

FIRST_CHUNK_ONLY = ("gpipe", "1f1b")


def check_layout(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
                 world_size: int, rank: int) -> None:
    if world_size != parallel.world_size:
        if parallel.tp == parallel.pp == 1:
            raise ValueError(f"world_size={world_size} but parallel.dp={parallel.dp}: they must be equal")
        raise ValueError(
            f"world_size={world_size} but parallel.dp*tp*pp = {parallel.dp}*{parallel.tp}*{parallel.pp} = "
            f"{parallel.world_size}: make the product equal the number of ranks"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    if data.seq_len > model.max_seq_len:
        raise ValueError(f"data.seq_len={data.seq_len} exceeds model.max_seq_len={model.max_seq_len}")
    microbatches_per_rank(train.global_batch, train.micro_batch, parallel.dp)
    check_tensor_parallel(model, parallel, data.seq_len)
    if parallel.pp > 1:
        check_pipeline(model, data, train, parallel)
    if world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"world_size={world_size} needs torch.distributed.init_process_group first")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"engine rank {rank}/{world_size} does not match the default process "
                f"group's rank {dist.get_rank()}/{dist.get_world_size()}"
            )


def check_pipeline(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig) -> None:
    """ValueError for pipeline layouts the engine cannot run correctly (module docstring)."""
    from trainer.engine_pipeline import plan_chunks, virtual_stages_of

    schedule, pp, dp, zero = parallel.schedule, parallel.pp, parallel.dp, parallel.zero
    if schedule == "pipedream":
        raise ValueError(
            "parallel.schedule='pipedream' is asynchronous (one-step-stale weights, no gradient clipping, no "
            "data parallelism) and does not run in this engine: train with trainer.pipedream.PipeDream2BW, or "
            "pick gpipe, 1f1b, interleaved or zero-bubble"
        )
    virtual = virtual_stages_of(parallel)
    if schedule in FIRST_CHUNK_ONLY and virtual != 1:
        raise ValueError(f"parallel.schedule={schedule!r} runs one chunk per rank, got parallel.virtual_stages="
                         f"{virtual}: use schedule 'interleaved' for virtual stages")
    if schedule == "interleaved" and virtual < 2:
        raise ValueError("parallel.schedule='interleaved' needs parallel.virtual_stages >= 2; use '1f1b' for one")
    if schedule == "zero-bubble":
        if virtual != 2:
            raise ValueError(f"parallel.schedule='zero-bubble' (ZB-V) needs exactly 2 chunks per rank, got "
                             f"parallel.virtual_stages={virtual}: set it to 2")
        if dp > 1 and zero in (0, 1):
            raise ValueError(f"parallel.schedule='zero-bubble' with dp={dp} and zero={zero} wraps stages in DDP, "
                             "with which torch 2.13's zero-bubble schedule crashes: use parallel.zero=2")
        if dp > 1 and zero == 3:
            raise ValueError("parallel.schedule='zero-bubble' computes wrong gradients with ZeRO-3 (FSDP2 "
                             "reshard_after_forward=True, torch 2.13): use parallel.zero=2, or schedule '1f1b' "
                             "with zero 3")
    plan_chunks(model, data, parallel)  # raises when the layers do not cut into pp * virtual chunks
    n_micro = microbatches_per_rank(train.global_batch, train.micro_batch, dp)
    if schedule == "1f1b" and n_micro < pp:
        raise ValueError(f"parallel.schedule='1f1b' needs at least pp={pp} microbatches per step, got {n_micro}: "
                         "raise train.global_batch or lower train.micro_batch or parallel.dp")
    rounds = max(1, n_micro // pp)
    if schedule == "interleaved" and n_micro % rounds:
        raise ValueError(f"parallel.schedule='interleaved' runs microbatches in rounds of pp={pp}; {n_micro} per "
                         f"step do not split into {rounds} rounds: use a multiple of {pp} microbatches")
