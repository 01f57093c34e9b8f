"""Typed configuration of the controller's monitoring endpoint.

This is the `monitor:` section of the job spec (`orchestrator.spec.job_spec.JobSpec`): where the
controller serves Prometheus metrics, and how often ranks report liveness to it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MonitorConfig(BaseModel):
    """Metrics endpoint and heartbeat period.

    `port: 0` asks the operating system for a free port when the controller starts; the
    chosen port is logged, so several jobs can share a machine without colliding.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 picks a free one")
    host: str = Field("127.0.0.1", min_length=1, description="interface to bind; 0.0.0.0 for all")
    heartbeat_s: float = Field(0.5, gt=0.0, description="seconds between rank heartbeats")
