"""Typed configuration of checkpointing: where checkpoints go, how often, how many are kept.

This is the `checkpoint:` section of the job spec (`orchestrator.spec.JobSpec`). It is
validated once, before any rank starts; whether the URL is actually reachable and writable
is probed separately by `orchestrator.storage_check.check_storage`, because that needs I/O.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CheckpointConfig(BaseModel):
    """Checkpoint destination and cadence.

    Cadence: `every_steps`, when set, saves every that many optimizer steps and `interval` is
    ignored. Otherwise `interval` is a period in seconds, or "young": the period is derived
    from measured costs with Young's formula tau = sqrt(2 * C * MTBF), where C is the measured
    save cost and MTBF is `mtbf_s` (Young 1974, https://doi.org/10.1145/361147.361115).
    """

    # `async` is a Python keyword, so the field is `async_` and YAML uses the alias; both
    # spellings are accepted when building the object.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    url: str = Field(..., description="fsspec URL (file://, s3://, ...) or a local path")
    interval: Literal["young"] | float = "young"
    every_steps: int | None = Field(None, gt=0)
    keep: int = Field(3, ge=1, description="committed checkpoints kept; older ones are deleted")
    async_: bool = Field(True, alias="async", description="stage to host memory, write in background")
    mtbf_s: float = Field(3600.0, gt=0.0, description="assumed system MTBF for Young's formula")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="passed to fsspec, e.g. {endpoint_url: http://minio:9000}"
    )

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, url: str) -> str:
        url = url.strip()
        if not url:
            raise ValueError("is empty; give an fsspec URL such as file:///data/ckpt or s3://bucket/prefix")
        if "://" not in url:
            # A plain path: make it absolute now, so every rank and the controller agree on it
            # whatever their working directory.
            url = "file://" + os.path.abspath(os.path.expanduser(url))
        protocol, _, path = url.partition("://")
        # A trailing slash would give "a//job" when the job name is appended; a bare root
        # ("file:///") keeps its slash because there is nothing else left of the path.
        return f"{protocol}://{path.rstrip('/') or '/'}"

    @field_validator("interval", mode="before")
    @classmethod
    def _check_interval(cls, value: Any) -> Any:
        # Checked before the union is tried so that the user gets one message, not one per
        # union member ("should be 'young'" and "should be a valid number").
        if value == "young":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected 'young' or a number of seconds, got {value!r}")
        if value <= 0:
            raise ValueError(f"must be a positive number of seconds or 'young', got {value!r}")
        return float(value)

    def join(self, *parts: str) -> str:
        """The URL of `parts` under `url`, joined with single slashes."""
        base = self.url if self.url.endswith("/") else self.url + "/"
        return base + "/".join(p.strip("/") for p in parts)
