"""`monitor.wandb`: the run's events logged to Weights & Biases.

The same tags as TensorBoard's (`monitor.events.Scalars`), one `log` call per event, each with
`train/step`: every metric is defined against `train/step` (`define_metric`),
not W&B's own step counter, because a rollback sends steps again and W&B drops a `step=` that
goes backwards. The spec, without storage options (they may hold credentials), is the run's
config. `mode` (online, offline, disabled) is W&B's; unset, WANDB_MODE or W&B's default decides.
Called from the controller thread only (monitor.tracking).
"""

from __future__ import annotations

from monitor.events import Scalars

STEP = "train/step"


class WandbSink:
    name = "wandb"

    def __init__(self, cfg, job: str, config: dict):
        import wandb

        self.run = wandb.init(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags),
                              name=cfg.name or job, mode=cfg.mode, dir=cfg.dir, config=config)
        self.where = f"project {cfg.project}, run {self.run.name} ({cfg.mode or 'WANDB_MODE or online'})"
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        self.scalars = Scalars()

    def emit(self, event: dict) -> None:
        step, row = self.scalars.row(event)
        if row:
            self.run.log({STEP: step, **row})

    def flush(self) -> None:
        """W&B's own service process streams what was logged; nothing to push from here."""

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() may return before W&B's service process has written the run's file (offline mode
        # showed it); teardown waits for that process, so the record is whole when the job exits.
        wandb.teardown()

