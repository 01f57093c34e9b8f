"""Which completed steps a rank checkpoints at: a plan shared by the controller through the store.

The controller publishes `{"version", "every", "anchor"}` under the generation's `plan` key;
ranks poll it at the heartbeat rate. A save happens after completed step `s` when
`s > anchor` and `(s - anchor) % every == 0`, and always at the final step.

Ranks may pick up a new plan at slightly different steps. That is safe by construction:
the controller commits a checkpoint only when every rank's receipt for that step is in,
so a step that only some ranks saved is never committed; its shards are garbage. The
controller sets `anchor` ahead of the fastest rank so this is rare.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPlan:
    every: int
    anchor: int = 0
    version: int = 0
    final_step: int | None = None
    tag: str = ""  # save attempt (controller run + generation), in shard file names
    # Epoch seconds at job second 0 (the goodput ledger's clock, carried across resumes), so
    # that a rank's storage faults read `at_seconds` and `duration_s` as job seconds.
    job_started_at: float | None = None

    def should_save(self, completed: int) -> bool:
        if self.final_step is not None and completed == self.final_step:
            return True
        return completed > self.anchor and (completed - self.anchor) % self.every == 0

    def to_json(self) -> dict:
        return {"every": self.every, "anchor": self.anchor, "version": self.version, "final_step": self.final_step,
                "tag": self.tag, "job_started_at": self.job_started_at}

    @classmethod
    def from_json(cls, data: dict) -> CheckpointPlan:
        return cls(**data)


def steps_for_interval(interval_s: float, step_s: float, lo: int = 1, hi: int = 1_000_000) -> int:
    """Whole steps closest to an interval in seconds, at least `lo`."""
    if step_s <= 0:
        return lo
    return max(lo, min(hi, round(interval_s / step_s)))
