"""The training processes of bench.recovery for Ray Train and torchrun (undying runs its own).

Both run the same loop as undying's ranks: `trainer.engine.Engine` built from the same job
spec (tiny GPT, DDP over gloo, 4 ranks), a checkpoint of the whole engine state every
`every` steps, and rank `kill_rank` SIGKILLing itself at the same fault point as undying's
`kill_rank` fault (after the backward of step `kill_step`) on the first attempt only: a
marker file, created just before the kill, says the kill has happened.

Measurements are wall-clock timestamps (`time.time()`, one clock for every process on the
machine) that the workers append as JSON lines to the `events` file:
  start     every rank, when its training function begins (attempt 0 before the kill, 1 after)
  restored  rank 0, the step the engine resumes at (0 on a fresh start)
  step      rank 0, each completed step with its global loss
  kill      the killed rank, just before it sends itself SIGKILL
  ray_actor the Ray Train driver, after fit(): Ray's start and end time of every worker actor

Entry points (from the repository root):
  torchrun ... -m bench.recovery.worker torchrun --config JSON   (what torchrun starts per rank)
  python -m bench.recovery.worker raytrain --config JSON         (the Ray Train driver: TorchTrainer.fit)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def emit(path: str, **fields) -> None:
    """Append one JSON line; a single O_APPEND write, so lines from many processes never interleave."""
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def build_engine(cfg: dict, rank: int, world_size: int):
    from orchestrator.spec.job_spec import load_spec
    from trainer.engine import Engine

    spec = load_spec(cfg["spec"], cfg["overrides"])
    return Engine(spec.model, spec.data, spec.train, spec.parallel, rank=rank, world_size=world_size), spec


def kill_hook(cfg: dict, rank: int):
    """The same fault as undying's `kill_rank` at `after_backward`, armed only before the first kill."""
    if rank != cfg["kill_rank"] or os.path.exists(cfg["marker"]):
        return None

    def hook(point: str, step: int) -> None:
        if point == "after_backward" and step == cfg["kill_step"]:
            open(cfg["marker"], "w").close()  # noqa: SIM115 (an empty marker, nothing to close later)
            emit(cfg["events"], ev="kill", rank=rank, step=step)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def train_loop(cfg: dict, rank: int, world_size: int, attempt: int, load, save) -> None:
    """Resume from `load()` (None or (tensors, meta)), train to the end, `save(engine)` every `every` steps.

    `save` is called on every rank (Ray Train's report is collective); it writes only on rank 0.
    """
    import torch

    torch.set_num_threads(1)
    emit(cfg["events"], ev="start", rank=rank, attempt=attempt)
    engine, spec = build_engine(cfg, rank, world_size)
    state = load()
    if state is not None:
        engine.load_state(*state)
    if rank == 0:
        emit(cfg["events"], ev="restored", rank=rank, attempt=attempt, step=engine.next_step)
    engine.fault_hook = kill_hook(cfg, rank)
    while engine.next_step < spec.train.steps:
        result = engine.train_step()
        if rank == 0:
            emit(cfg["events"], ev="step", rank=rank, attempt=attempt, step=result.step, loss=result.loss)
        if engine.next_step % cfg["every"] == 0:
            save(engine)


def engine_state(engine) -> dict:
    return {"tensors": engine.state_tensors(), "meta": engine.state_meta()}


# ---- torchrun ----------------------------------------------------------------------------------


def torchrun_worker(cfg: dict) -> None:
    """One torchrun rank: rank and world from torchrun's environment, checkpoint with torch.save."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = os.path.join(cfg["ckpt_dir"], "state.pt")

    def load():
        if not os.path.exists(path):
            return None
        saved = torch.load(path, weights_only=True)
        return saved["tensors"], saved["meta"]

    def save(engine) -> None:
        if rank == 0:  # DDP replicas are identical: one copy is the whole state
            tmp = f"{path}.tmp"
            torch.save(engine_state(engine), tmp)
            os.replace(tmp, path)  # atomic: a kill mid-save leaves the previous checkpoint

    train_loop(cfg, rank, world_size, attempt, load, save)
    dist.destroy_process_group()


# ---- Ray Train ---------------------------------------------------------------------------------


def raytrain_worker(cfg: dict) -> None:
    """The `train_loop_per_worker` of the TorchTrainer: Ray Train formed the gloo process group."""
    import tempfile

    import ray.train
    import torch

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    attempt = 1 if os.path.exists(cfg["marker"]) else 0
    checkpoint = ray.train.get_checkpoint()

    def load():
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
        return saved["tensors"], saved["meta"]

    def save(engine) -> None:
        metrics = {"step": engine.next_step}
        if rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        with tempfile.TemporaryDirectory() as folder:
            torch.save(engine_state(engine), os.path.join(folder, "state.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    train_loop(cfg, rank, world_size, attempt, load, save)


def raytrain_driver(cfg: dict) -> int:
    """Run the TorchTrainer to completion on the Ray cluster at cfg['address']; record its actors."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=cfg["address"], logging_level="ERROR", log_to_driver=False)
    # By its module name, not as __main__: Ray pickles it by reference and its workers import it
    # from PYTHONPATH (the repository root, bench.recovery.ray_head.worker_env).
    from bench.recovery.worker import raytrain_worker

    trainer = TorchTrainer(
        raytrain_worker,
        train_loop_config=cfg,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=cfg["world_size"], use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=cfg["run_name"], storage_path=cfg["ckpt_dir"],
                             failure_config=FailureConfig(max_failures=cfg["max_restarts"]),
                             checkpoint_config=CheckpointConfig(num_to_keep=3)),
    )
    trainer.fit()
    # Ray's own record of when each worker actor started and ended (ms since the epoch): the
    # end of the killed attempt's survivors is when Ray Train tore the old worker group down.
    # A private API (no dashboard on the bench's head, so no state API): a cross-check only, skipped if gone.
    try:
        actors = list(ray._private.state.actors().values())
    except Exception as err:
        print(f"no actor table ({type(err).__name__}: {err}); skipping the teardown cross-check", file=sys.stderr)
        actors = []
    for actor in actors:
        if "RayTrainWorker" in actor["ActorClassName"]:
            emit(cfg["events"], ev="ray_actor", actor_pid=actor["Pid"], start_ms=actor["StartTime"],
                 end_ms=actor["EndTime"], state=actor["State"])
    ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery.worker")
    parser.add_argument("role", choices=["torchrun", "raytrain"])
    parser.add_argument("--config", required=True, help="the run's settings as JSON")
    args = parser.parse_args(argv)
    cfg = json.loads(args.config)
    if args.role == "torchrun":
        torchrun_worker(cfg)
        return 0
    return raytrain_driver(cfg)


if __name__ == "__main__":
    sys.exit(main())
