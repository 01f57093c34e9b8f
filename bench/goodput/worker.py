"""The Ray Train side of bench.goodput: the engine's training loop under a step-triggered kill schedule.

The same loop as bench/recovery/worker.py (trainer.engine.Engine from the undying spec, a whole-
state checkpoint through `ray.train.report` every `every` steps), and the same kills as undying's:
kill i SIGKILLs the worker holding world rank `r` after the backward of step `s` (undying's
`kill_rank` at `after_backward`), once per job whichever attempt reaches it (a marker file created
exclusively just before the kill): both systems fail at the same point of their training, however
long each took to start.

Events (JSON lines, `time.time()`): `fit_start`/`fit_end` (driver), `start` (every worker),
`restored` (rank 0, the resumed step), `step` (rank 0: step, loss, the engine's step seconds),
`kill` (the killed worker, kill id and step).

    python -m bench.goodput.worker --config JSON      (from the repository root)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

from bench.recovery.worker import build_engine, emit, engine_state


def kill_hook(cfg: dict, rank: int):
    """The kills of `cfg["kills"]` ((step, rank) pairs) that fall on this rank, each the same fault as
    undying's `kill_rank` at `after_backward` of its step, fired once over all attempts: a marker
    file, created exclusively just before the SIGKILL, says it happened (a replayed step is spared)."""
    mine = {step: kill_id for kill_id, (step, target) in enumerate(cfg["kills"]) if target == rank}

    def hook(point: str, step: int) -> None:
        kill_id = mine.get(step)
        if point != "after_backward" or kill_id is None:
            return
        try:
            os.close(os.open(os.path.join(cfg["markers"], f"kill-{kill_id}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        emit(cfg["events"], ev="kill", rank=rank, kill=kill_id, step=step)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook if mine else None


def raytrain_worker(cfg: dict) -> None:
    import ray.train
    import torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    emit(cfg["events"], ev="start", rank=rank)
    engine, spec = build_engine(cfg, rank, world_size)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        engine.load_state(saved["tensors"], saved["meta"])
    if rank == 0:
        emit(cfg["events"], ev="restored", rank=rank, step=engine.next_step)
    engine.fault_hook = kill_hook(cfg, rank)
    while engine.next_step < spec.train.steps:
        result = engine.train_step()
        if rank == 0:
            emit(cfg["events"], ev="step", rank=rank, step=result.step, loss=result.loss, step_s=result.step_s)
        if engine.next_step % cfg["every"] == 0 or engine.next_step == spec.train.steps:
            metrics = {"step": engine.next_step}
            if rank != 0:
                ray.train.report(metrics, checkpoint=None)
                continue
            with tempfile.TemporaryDirectory() as folder:
                torch.save(engine_state(engine), os.path.join(folder, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def raytrain_driver(cfg: dict) -> int:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=cfg["address"], logging_level="ERROR", log_to_driver=False)
    # By its module name, not as __main__: Ray pickles it by reference and its workers import it
    # from PYTHONPATH (the repository root, bench.recovery.ray_head.worker_env).
    from bench.goodput.worker import raytrain_worker

    os.makedirs(cfg["markers"], exist_ok=True)
    cfg = dict(cfg, t0=time.time())  # the job's clock starts here, as undying's ledger at its controller
    emit(cfg["events"], ev="fit_start", t0=cfg["t0"])
    trainer = TorchTrainer(
        raytrain_worker, train_loop_config=cfg, torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=cfg["world_size"], use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=cfg["run_name"], storage_path=cfg["ckpt_dir"],
                             failure_config=FailureConfig(max_failures=cfg["max_restarts"]),
                             checkpoint_config=CheckpointConfig(num_to_keep=3)),
    )
    trainer.fit()
    emit(cfg["events"], ev="fit_end")
    ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.goodput.worker")
    parser.add_argument("--config", required=True, help="the run's settings as JSON")
    return raytrain_driver(json.loads(parser.parse_args(argv).config))


if __name__ == "__main__":
    sys.exit(main())
