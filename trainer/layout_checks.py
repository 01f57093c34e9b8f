"""Construction-time checks of the layout an engine is asked to run (issue 3, item 7).

Called first thing by `Engine.__init__`, before any collective, so a bad combination fails on
every rank with the same message, naming the field and the fix.
"""

from __future__ import annotations

import torch.distributed as dist

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import microbatches_per_rank
from trainer.tensor_parallel import check_tensor_parallel


def check_layout(model: ModelConfig, data: DataConfig, train: TrainConfig, parallel: ParallelConfig,
                 world_size: int, rank: int) -> None:
    if parallel.pp != 1:
        raise NotImplementedError(
            f"parallel.pp={parallel.pp}: this engine runs pipeline parallelism through a pipeline runner "
            "that is not wired in yet; set parallel.pp=1"
        )
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
    if world_size > 1:
        if not dist.is_initialized():
            raise RuntimeError(f"world_size={world_size} needs torch.distributed.init_process_group first")
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"engine rank {rank}/{world_size} does not match the default process "
                f"group's rank {dist.get_rank()}/{dist.get_world_size()}"
            )
