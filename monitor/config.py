"""Typed configuration of the controller's monitoring endpoint.

This is the `monitor:` section of the job spec (`orchestrator.spec.job_spec.JobSpec`): where the
controller serves Prometheus metrics, how often ranks report liveness to it, and where the run's
events are tracked besides the event log under the checkpoint root (monitor.tracking).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from trainer.spec_section import SpecSection


class WandbConfig(SpecSection):
    """`monitor.wandb`: the Weights & Biases run the controller logs to (monitor.wandb_sink)."""

    project: str = Field(min_length=1, description="W&B project to log the run to")
    entity: str | None = Field(None, min_length=1, description="W&B team or user; unset: your default entity")
    name: str | None = Field(None, min_length=1, description="the W&B run's name; unset: the job's name")
    group: str | None = Field(None, min_length=1, description="W&B group, e.g. to gather the runs of a sweep")
    tags: list[str] = Field(default_factory=list, description="W&B tags of the run")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B's mode; unset: WANDB_MODE, else online (offline: `wandb sync` uploads later)")
    dir: str | None = Field(None, min_length=1, description="local directory for W&B's files; unset: ./wandb")


class MonitorConfig(SpecSection):
    """Metrics endpoint and heartbeat period.

    `port: 0` asks the operating system for a free port when the controller starts; the
    chosen port is logged, so several jobs can share a machine without colliding.
    """

    port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 picks a free one")
    host: str = Field("127.0.0.1", min_length=1, description="interface to bind; 0.0.0.0 for all")
    heartbeat_s: float = Field(0.5, gt=0.0, description="seconds between rank heartbeats; at most half the "
                               "hang limit (elastic.hang_timeout_s, or its 10 s floor)")
    tensorboard: str | None = Field(
        None, min_length=1, description="directory or URL (s3://...) for TensorBoard event files: every step's "
        "loss, tokens/s, MFU, validation loss, goodput buckets, checkpoints and recoveries; needs undying[tensorboard]")
    wandb: WandbConfig | None = Field(None, description="log the same scalars to Weights & Biases; needs "
                                      "undying[wandb]")

    @field_validator("host")
    @classmethod
    def _an_interface(cls, host: str) -> str:
        # What a user pastes from elsewhere: a URL, or an address with its port (IPv6 literals have colons).
        if "://" in host or "/" in host:
            raise ValueError(f"{host!r} is a URL; give the interface's address, e.g. 0.0.0.0 (all) or 127.0.0.1")
        if re.fullmatch(r"[^:]+:\d+", host):
            raise ValueError(f"{host!r} carries a port; give the address alone and the port as monitor.port")
        return host
