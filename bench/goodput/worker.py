"""The Ray Train side of bench.goodput: the engine's training loop under a time-triggered kill schedule.

The same loop as bench/recovery/worker.py (trainer.engine.Engine from the undying spec, a whole-
state checkpoint through `ray.train.report` every `every` steps), but the kills are the ones
undying's controller fires for `chaos.mtbf_s` (chaos.schedule.expand, the same seed): kill i is
due `at` seconds after the driver starts `fit()` and hits whichever worker holds world rank `r`
then. Each worker runs a thread that sleeps until its rank's next due kill, creates the kill's
marker file exclusively (so a kill fires once per job, whichever attempt reaches it) and sends
itself SIGKILL; kills that fell due while the group restarted fire right after the restore, as
undying fires them as soon as its ranks train again.

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
import threading
import time

from bench.recovery.worker import build_engine, emit, engine_state


def _kill_thread(cfg: dict, rank: int, engine) -> None:
    def run() -> None:
        for kill_id, (at, target) in enumerate(cfg["kills"]):
            if target != rank or os.path.exists(os.path.join(cfg["markers"], f"kill-{kill_id}")):
                continue
            time.sleep(max(0.0, cfg["t0"] + at - time.time()))
            try:  # exclusive: exactly one worker, in one attempt, fires each kill
                os.close(os.open(os.path.join(cfg["markers"], f"kill-{kill_id}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            emit(cfg["events"], ev="kill", rank=rank, kill=kill_id, step=engine.next_step, due=cfg["t0"] + at)
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, daemon=True, name="kill-schedule").start()


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
    _kill_thread(cfg, rank, engine)
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
    cfg = dict(cfg, t0=time.time())  # the job clock the kill times count from, as undying's ledger
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
