"""The runs bench.ps measures: collective data parallelism on gloo ranks, and parameter-server
jobs on the embedded local Ray, from one description of the job.

Protocol: bench/ps/main.py calls `run_collective` (before Ray starts: its ranks are plain
processes, tests.dist._launch.run_ranks, one thread each) and then, inside `local_ray()`,
`run_parameter_server` once per consistency model. `job` is a plain dict (it crosses process
boundaries): model keyword arguments, seq_len, global_batch, micro_batch, steps, lr, workers,
servers, staleness. A straggler is `slow = {worker or rank: seconds}`: a ps worker sleeps that
long each step after computing (run_ps's `slow`); a collective rank sleeps it each step after the
forward, through chaos' own slow_rank fault (delay_s, repeat), so both are slowed the same.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig


def configs(job: dict) -> tuple[ModelConfig, DataConfig, TrainConfig]:
    model = ModelConfig(**job["model"])
    data = DataConfig(seq_len=job["seq_len"], min_len_fraction=1.0)
    # No clipping: a ps job refuses it (no process sees every shard's gradient).
    train = TrainConfig(steps=job["steps"], global_batch=job["global_batch"], micro_batch=job["micro_batch"],
                        lr=job["lr"], grad_clip=None)
    return model, data, train


def _collective_rank(rank: int, world: int, job: dict, slow: dict[int, float]) -> list[dict]:
    """Run by run_ranks on every rank: `steps` steps of the engine at dp = world."""
    from chaos.injector import FaultInjector
    from trainer.engine import Engine

    model, data, train = configs(job)
    hook = None
    if rank in slow:
        fault = {"kind": "slow_rank", "rank": rank, "delay_s": slow[rank], "repeat": True, "at_step": 0}
        hook = FaultInjector.hook_for([fault], rank, notify=lambda notice: None)
    engine = Engine(model, data, train, ParallelConfig(dp=world), rank=rank, world_size=world, fault_hook=hook)
    out = []
    for _ in range(train.steps):
        result = engine.train_step()
        out.append({"ended": time.time(), "loss": result.loss, "tokens": result.tokens})
    return out


def run_collective(job: dict, slow: dict[int, float]) -> list[list[dict]]:
    """Every rank's step records of one collective run."""
    from tests.dist._launch import run_ranks

    return run_ranks(_collective_rank, job["workers"], args=(job, slow), timeout_s=120 + 3 * job["steps"])


@contextlib.contextmanager
def local_ray(job: dict):
    """The embedded local Ray (never a cluster RAY_ADDRESS names: the bench measures this machine),
    with a logical CPU per actor; shut down at the end."""
    from orchestrator.cluster import ray_cluster

    os.environ.pop("RAY_ADDRESS", None)
    conn = ray_cluster.connect(None, job["workers"] + job["servers"], 0)
    try:
        yield
    finally:
        conn.close()


def run_parameter_server(job: dict, consistency: str, slow: dict[int, float]):
    """One ps run (paramserver.job.run_ps): its PSReport."""
    from paramserver.job import run_ps

    model, data, train = configs(job)
    parallel = ParallelConfig(dp=job["workers"], mode="ps", servers=job["servers"], consistency=consistency,
                              staleness=job["staleness"] if consistency == "ssp" else None)
    return run_ps(model, data, train, parallel, slow=slow)


def touched_rows(job: dict) -> list[int]:
    """Per (step, worker): the embedding rows that step's tokens read, as a ps worker's sparse pull
    and push carry them (paramserver.worker.PSWorker.rows_needed), computed from the data alone."""
    from trainer.data import make_cursor

    model, data, train = configs(job)
    cursor = make_cursor(data, model.vocab_size)
    out = []
    for step in range(train.steps):
        for worker in range(job["workers"]):
            batches = cursor.microbatches(step, train.global_batch, train.micro_batch, worker, job["workers"],
                                          record=False)  # a look: made on the spot, no read-ahead
            out.append(int(torch.unique(torch.cat([b.input_ids.flatten() for b in batches])).numel()))
    cursor.close()
    return out


def state_bytes(job: dict) -> dict[str, int]:
    """S (every parameter), the sparse embedding's bytes and one row's bytes, from a meta model."""
    from paramserver.worker import SPARSE_PARAM
    from trainer.model import meta_model

    params = dict(meta_model(ModelConfig(**job["model"])).named_parameters())
    nbytes = {name: p.numel() * p.element_size() for name, p in params.items()}
    emb = params[SPARSE_PARAM]
    return {"state": sum(nbytes.values()), "embedding": nbytes[SPARSE_PARAM],
            "row": emb.shape[1] * emb.element_size()}
