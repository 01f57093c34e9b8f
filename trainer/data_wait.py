"""The wait a step spent on its samples, as the job saw it: the slowest rank's wait.

A rank whose samples are ready waits for one whose are not inside the step's first
collective, and books that time as compute. So a rank's own wait says nothing about the
step's: when the data store stalls, the rank that reads ahead furthest (rank 0, say, holding
the stalled step's samples from before the stall) reports no wait while the job stood still.
The controller books the step's `data_wait_s` (from rank 0's report) as `data` badput, so
every rank reports the longest wait of any rank of the job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def slowest_wait(own_wait_s: float, world_size: int, device: torch.device) -> float:
    """The longest any rank of the job waited for this step's samples.

    Collective over the default process group (every rank of the job): every rank calls it
    once per step, right after its samples arrived, with how long it waited for them. One
    8-byte all-reduce: the step's ranks meet at the step's first collective anyway."""
    if world_size == 1:
        return own_wait_s
    longest = torch.tensor([own_wait_s], dtype=torch.float64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    return float(longest)
