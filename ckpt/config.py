"""Typed configuration of checkpointing: where checkpoints go, how often, how many are kept.

This is the `checkpoint:` section of the job spec (`orchestrator.spec.job_spec.JobSpec`). It is
validated once, before any rank starts; whether the URL is actually reachable and writable
is probed separately by `orchestrator.spec.storage_check.check_storage`, because that needs I/O.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ckpt.storage_errors import DEFAULT_READ_RETRY_S

# fsspec protocols of object stores, whose Python clients hold the GIL for much of an upload.
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})


def normalise_url(url: str) -> str:
    """An fsspec URL with an absolute path and no trailing slash; ValueError when empty."""
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


class MemoryLevelConfig(BaseModel):
    """The memory level (docs/design.md, "Two levels"): snapshots in the ranks' host memory, each
    rank's copied to a buddy on another node. Cadence as for storage: `every_steps`, else
    `interval` ("young", "young-daly" or seconds) with C the measured blocking cost of a memory
    snapshot and the job's MTBF. `max_host_bytes`: a per-rank limit on the host memory the level
    may hold (its staging buffer, two own snapshots, two buddy copies), checked before any rank
    starts against the spec's state size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    every_steps: int | None = Field(None, gt=0)
    interval: Literal["young", "young-daly"] | float = "young"
    max_host_bytes: int | None = Field(None, gt=0)

    @field_validator("interval", mode="before")
    @classmethod
    def _check_interval(cls, value: Any) -> Any:
        return _interval(value)


def _interval(value: Any) -> Any:
    # Checked before the union is tried so that the user gets one message, not one per
    # union member ("should be 'young'" and "should be a valid number").
    if value in ("young", "young-daly"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected 'young', 'young-daly' or a number of seconds, got {value!r}")
    if value <= 0:
        raise ValueError(f"must be a positive number of seconds, 'young' or 'young-daly', got {value!r}")
    return float(value)


class CheckpointConfig(BaseModel):
    """Checkpoint destination and cadence.

    Cadence, first match wins: `every_steps: k` saves every k optimizer steps; `every_seconds: t`
    about every t seconds (converted to steps with the measured step time); otherwise
    `interval`: "young" (tau = sqrt(2 C M)), "young-daly" (tau = C + sqrt(2 (M + R) C + C^2)),
    or a number of seconds (same as every_seconds). C is the measured blocking cost of a save
    (moving average), R the measured restart time, M the system MTBF: a prior (`mtbf_s`, or
    `node_mtbf_hours` divided by the number of nodes the job runs on) updated with the
    failures the job observes (ckpt.interval).
    """

    # `async` is a Python keyword, so the field is `async_` and YAML uses the alias; both
    # spellings are accepted when building the object.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    url: str = Field(..., description="fsspec URL (file://, s3://, ...) or a local path")
    interval: Literal["young", "young-daly"] | float = "young"
    every_steps: int | None = Field(None, gt=0)
    every_seconds: float | None = Field(None, gt=0.0)
    keep: int = Field(3, ge=1, description="committed checkpoints kept; older ones are deleted")
    max_failed_saves: int = Field(
        3, ge=1, description="consecutive saves that may fail (a shard write or the commit) before the job fails "
        "with the storage error rather than train on with nothing durable; a commit resets the count")
    async_: bool = Field(True, alias="async", description="stage to host memory, write in background")
    writer: Literal["auto", "thread", "process"] = Field(
        "auto", description="where async shard writes run: a thread of the rank, or a child process of it "
        "(ckpt.process_writer: for object stores, whose Python clients hold the GIL while uploading); auto picks "
        "the process for object stores and the thread otherwise")
    mtbf_s: float = Field(3600.0, gt=0.0, description="prior system MTBF (seconds) for the interval formulas")
    node_mtbf_hours: float | None = Field(
        None, gt=0.0, description="prior MTBF of one node; when set, the system prior is this / nodes"
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="passed to fsspec, e.g. {endpoint_url: http://minio:9000}"
    )
    read_retry_s: float = Field(
        DEFAULT_READ_RETRY_S, ge=0.0, description="how long the store's transient read failures (timeouts, 5xx, "
        "throttling), retried with backoff, may delay one restore in all before the job fails naming the "
        "checkpoint (0: no retry)")
    memory: MemoryLevelConfig = Field(default_factory=MemoryLevelConfig)

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, url: str) -> str:
        return normalise_url(url)

    @field_validator("interval", mode="before")
    @classmethod
    def _check_interval(cls, value: Any) -> Any:
        return _interval(value)

    @model_validator(mode="after")
    def _one_cadence(self) -> CheckpointConfig:
        if self.every_steps is not None and self.every_seconds is not None:
            raise ValueError(
                f"every_steps={self.every_steps} and every_seconds={self.every_seconds} are both set: "
                "keep one of them (or neither, to use `interval`)"
            )
        return self

    @model_validator(mode="after")
    def _process_writer_fits(self) -> CheckpointConfig:
        if self.writer != "process":
            return self
        if not self.async_:
            raise ValueError("writer='process' writes in the background, but async is false (a synchronous save "
                             "writes from the training thread): set async: true, or writer: thread")
        if self.protocol == "memory":
            raise ValueError("writer='process' cannot write to memory:// (a store per process: the rank would never "
                             "see its writer's shards): use writer: thread or auto")
        return self

    @property
    def protocol(self) -> str:
        return self.url.partition("://")[0]

    @property
    def resolved_writer(self) -> str:
        """"thread" or "process": `writer`, with auto resolved (a process for object stores, when async)."""
        if self.writer != "auto":
            return self.writer
        return "process" if self.async_ and self.protocol in OBJECT_STORES else "thread"

    @property
    def rule(self) -> str:
        """"steps", "seconds", "young" or "young-daly": which cadence applies."""
        if self.every_steps is not None:
            return "steps"
        if self.every_seconds is not None or not isinstance(self.interval, str):
            return "seconds"
        return self.interval

    @property
    def fixed_seconds(self) -> float | None:
        if self.every_seconds is not None:
            return self.every_seconds
        return None if isinstance(self.interval, str) else float(self.interval)

    def memory_cadence(self) -> CheckpointConfig:
        """This config with the memory level's cadence, for an interval policy of its own."""
        memory = self.memory
        return self.model_copy(update={"every_steps": memory.every_steps, "every_seconds": None,
                                       "interval": memory.interval})

    def join(self, *parts: str) -> str:
        """The URL of `parts` under `url`, joined with single slashes."""
        base = self.url if self.url.endswith("/") else self.url + "/"
        return base + "/".join(p.strip("/") for p in parts)
