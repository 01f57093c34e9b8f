"""A step's data wait is the slowest rank's: 4 gloo ranks (dp 2 x tp 2), one of them slow to read.

The rank that is neither rank 0's dp peer nor its tp peer takes 1 s to read step 0's samples.
Rank 0 has its own samples at once and waits for that rank inside the step's first collective;
the job's record of the step (rank 0's report, booked as `data` badput) must still say 1 s.
"""

from __future__ import annotations

import time

import pytest

from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

pytestmark = pytest.mark.dist

SLOW_RANK, DELAY_S = 3, 1.0


def train_with_a_slow_reader(rank: int, world_size: int) -> tuple[list[float], float]:
    """Runs on every rank: 3 steps; (each step's reported data wait, this rank's own wait at step 0)."""
    engine = Engine(ModelConfig(preset="tiny"), DataConfig(seq_len=16),
                    TrainConfig(steps=3, global_batch=4, micro_batch=1, warmup_steps=1),
                    ParallelConfig(dp=2, tp=2), rank=rank, world_size=world_size)
    if rank == SLOW_RANK:
        load = engine.data._load

        def slow_first_step(key):  # the store answers this rank's first read late
            if key[0] == 0:
                time.sleep(DELAY_S)
            return load(key)

        engine.data._load = slow_first_step
    waits, own = [], None
    for _ in range(3):
        waits.append(engine.train_step().data_wait_s)
        own = engine.data.last_wait_s if own is None else own
    return waits, own


def test_every_rank_reports_the_slowest_ranks_wait_for_its_samples():
    ranks = run_ranks(train_with_a_slow_reader, 4)
    rank0_waits, rank0_own = ranks[0]
    assert rank0_own < DELAY_S / 2  # rank 0 itself had its samples at once ...
    assert rank0_waits[0] >= DELAY_S  # ... yet its report of the step carries the slow rank's wait
    assert ranks[SLOW_RANK][1] >= DELAY_S
    for waits, _ in ranks:
        assert waits[0] == rank0_waits[0]  # one value, the same on every rank
        assert max(waits[1:]) < DELAY_S / 2  # later steps were read ahead while step 0 trained


def test_the_data_wait_benchmark_times_both_collectives_on_the_same_ranks():
    from bench.engine.data_wait import measure

    row = measure(2, calls=20)
    assert row["world"] == 2 and row["count_us"] > 0 and row["wait_us"] > 0
    assert row["ratio"] == pytest.approx(row["wait_us"] / row["count_us"])
