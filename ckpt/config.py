"""Typed configuration of checkpointing: where checkpoints go, how often, how many are kept.

This is the `checkpoint:` section of the job spec (`orchestrator.spec.job_spec.JobSpec`). It is
validated once, before any rank starts; whether the URL is actually reachable and writable
is probed separately by `orchestrator.spec.storage_check.check_storage`, because that needs I/O.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ckpt.storage_errors import DEFAULT_READ_RETRY_S
from trainer.spec_section import SpecSection
from trainer.urls import OBJECT_STORES, absolute_url

# Protocols whose stores create a file only if it is absent, atomically (ckpt.storage): a local or
# shared file system (link(2)), S3 (If-None-Match), and memory:// (one process: tests).
EXCLUSIVE_CREATE = frozenset({"file", "s3", "s3a", "memory"})

# Where Ray unpacks a job's `--working-dir` on each node: a driver started by `ray job submit` runs there.
RAY_WORKING_DIR_COPY = "/runtime_resources/working_dir_files/"


def refuse_a_path_in_rays_copy(url: str) -> None:
    """ValueError for a relative checkpoint path under a driver that `ray job submit --working-dir` started:
    it would name a folder inside Ray's copy of the working directory (one per upload, on one node), so
    the next submission would start again at step 0, this one's checkpoints left in Ray's cache."""
    path = url.strip()
    if "://" in path or os.path.isabs(os.path.expanduser(path)):
        return
    if RAY_WORKING_DIR_COPY in os.path.abspath(path) + "/":
        raise ValueError(f"{url!r} is relative, and this driver runs in Ray's copy of the job's working directory "
                         f"({os.getcwd()}), which each `ray job submit` makes anew on one node; give a path every "
                         "node shares (file:///mnt/shared/ckpt) or an object store (s3://bucket/prefix)")


INTERVAL_FORMS = ("'young', 'young-daly' or a number of seconds, or the unit spelled out: '500 steps', '90s', "
                  "'10m', '1h'")
_STEPS = re.compile(r"\s*(\d+)\s*steps?\s*")
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(s|m|h)\s*")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
# JSON Schema of `interval` (`undying spec --schema`): the spelled-out forms are strings too.
_INTERVAL_SCHEMA = {"anyOf": [{"enum": ["young", "young-daly"]}, {"type": "number", "exclusiveMinimum": 0},
                              {"type": "string", "pattern": r"^\s*\d+\s*steps?\s*$|^\s*\d+(\.\d*)?\s*[smh]\s*$"}]}


class _BadInterval(str):
    """A spelled-out interval the section's before-validator refused, carrying its message: it is
    left in the `interval` field so that the field validator raises it and the error names
    `checkpoint.interval` (an error raised by the section's validator names only the section)."""


def _interval(value: Any) -> Any:
    # Checked before the union is tried so that the user gets one message, not one per
    # union member ("should be 'young'" and "should be a valid number").
    if isinstance(value, _BadInterval):
        raise ValueError(str(value))
    if value in ("young", "young-daly"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected {INTERVAL_FORMS}; got {value!r}")
    if not 0 < value < math.inf:  # nan fails this too
        raise ValueError(f"must be a positive number of seconds, 'young' or 'young-daly', or the unit spelled out "
                         f"('500 steps', '90s'); got {value!r}")
    return float(value)


def spelled_cadence(data: Any, seconds_field: str) -> Any:
    """The section's data with `interval: 500 steps` moved to `every_steps: 500`, and `interval: 90s`
    (or 10m, 1h) to `seconds_field` as seconds. TorchTitan's `checkpoint.interval: 500` counts
    steps while a bare number here counts seconds, so the unit can be written out instead.
    Called by the sections' before-validators; anything else passes on unchanged, and a spelled-out
    interval that is wrong stays in `interval` as a `_BadInterval` for the field validator to report."""
    text = data.get("interval") if isinstance(data, dict) else None
    if not isinstance(text, str) or text in ("young", "young-daly"):
        return data
    steps, duration = _STEPS.fullmatch(text), _DURATION.fullmatch(text)
    if steps is None and duration is None:
        return data  # the field validator reports it with the accepted forms
    field = "every_steps" if steps else seconds_field
    value = int(steps.group(1)) if steps else float(duration.group(1)) * _UNIT_S[duration.group(2)]
    if value <= 0:
        return {**data, "interval": _BadInterval(f"{text!r} must be positive: {INTERVAL_FORMS}")}
    given = [k for k in ("every_steps", "every_seconds") if data.get(k) is not None]
    if given:
        return {**data, "interval": _BadInterval(f"{text!r} and {given[0]}: {data[given[0]]} both give the "
                                                 "cadence; keep one")}
    rest = {k: v for k, v in data.items() if k != "interval"}
    return {**rest, field: value}


class MemoryLevelConfig(SpecSection):
    """The memory level (docs/design.md, "Two levels"): snapshots in the ranks' host memory, each
    rank's copied to a buddy on another node. Cadence as for storage: `every_steps`, else
    `interval` ("young", "young-daly" or seconds) with C the measured blocking cost of a memory
    snapshot and the job's MTBF. `max_host_bytes`: a per-rank limit on the host memory the level
    may hold (its staging buffer, two own snapshots and two buddy copies, a third of each while a new
    one lands), checked before any rank starts against the spec's state size."""

    enabled: bool = Field(True, description="keep in-memory snapshots (each copied to a buddy rank on another node) "
                          "beside the storage checkpoints; a failure's recovery restores from them when it can "
                          "(default on; off by default with parallel.mode ps, which keeps none)")
    every_steps: int | None = Field(None, gt=0, description="snapshot every this many optimizer steps (else "
                                    "`interval`)")
    interval: Literal["young", "young-daly"] | float = Field(
        "young", json_schema_extra=_INTERVAL_SCHEMA, description="snapshot cadence when every_steps is unset: 'young' "
        "or 'young-daly' (from the measured snapshot cost and the MTBF), 'N steps', a duration ('90s', '10m') or a "
        "bare number of seconds")
    max_host_bytes: int | None = Field(None, gt=0, description="per-rank limit on the host memory the level may "
                                       "hold (staging buffer, two own snapshots and two buddy copies, a third of "
                                       "each while a new one lands: 7 shares of the rank's state), checked before "
                                       "any rank starts")

    @model_validator(mode="before")
    @classmethod
    def _spelled_out(cls, data: Any) -> Any:
        return spelled_cadence(data, "interval")

    @field_validator("interval", mode="before")
    @classmethod
    def _check_interval(cls, value: Any) -> Any:
        return _interval(value)


class CheckpointConfig(SpecSection):
    """Checkpoint destination and cadence.

    Cadence, first match wins: `every_steps: k` saves every k optimizer steps; `every_seconds: t`
    about every t seconds (converted to steps with the measured step time); otherwise
    `interval`: "young" (tau = sqrt(2 C M)), "young-daly" (tau = C + sqrt(2 (M + R) C + C^2)),
    or a number of seconds (same as every_seconds); `interval: 500 steps` and `interval: 90s` (10m,
    1h) are every_steps and every_seconds spelled out. C is the measured blocking cost of a save
    (moving average), R the measured restart time, M the system MTBF: a prior (`mtbf_s`, or
    `node_mtbf_hours` divided by the number of nodes the job runs on) updated with the
    failures the job observes (ckpt.interval).
    """

    # `async` is a Python keyword, so the field is `async_` and YAML uses the alias; both
    # spellings are accepted when building the object.
    model_config = ConfigDict(populate_by_name=True)  # with SpecSection's: unknown keys refused, frozen

    url: str = Field(..., description="file:// (a local or shared file system), s3:// (S3 or any S3-compatible "
                                      "store), or a local path")
    interval: Literal["young", "young-daly"] | float = Field(
        "young", json_schema_extra=_INTERVAL_SCHEMA, description="cadence when every_steps and every_seconds are "
        "unset: 'young' or 'young-daly' (computed from the measured save cost and the MTBF), 'N steps' (same as "
        "every_steps: N), a duration '90s', '10m', '1h' (same as every_seconds), or a bare number, which counts "
        "SECONDS (TorchTitan's checkpoint.interval counts steps: write '500 steps' or every_steps: 500 for that)")
    every_steps: int | None = Field(None, gt=0, description="save every this many optimizer steps")
    every_seconds: float | None = Field(None, gt=0.0, description="save about every this many seconds (converted "
                                        "to steps with the measured step time)")
    keep: int = Field(3, ge=1, description="committed checkpoints kept; older ones are deleted")
    max_failed_saves: int = Field(
        3, ge=1, description="consecutive saves that may fail (a shard write or the commit) before the job fails "
        "with the storage error rather than train on with nothing durable; a commit resets the count")
    async_: bool = Field(True, alias="async", description="stage to host memory, write in background "
                         "(parallel.mode ps: false, and true is refused)")
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
    owner_lease_s: float = Field(
        60.0, ge=1.0, description="the driver's lease on the checkpoint root (renewed every sixth of it), so that "
        "two drivers never run one job: a second `undying run` of a live job is refused; one whose driver died "
        "takes over at once on the same host, else after watching the dead driver's heartbeat for this long and "
        "one beat more")
    commit_timeout_s: float = Field(
        600.0, gt=0.0, description="how long a manifest create (with its retry) may go unanswered: past it the "
        "saves complete behind it count as failed (against max_failed_saves), and a recovery, a grow or the job's "
        "end that waits for it fails the job naming the step (the create may still land; a rerun resumes from the "
        "newest commit it finds; during a signal's grace the grace ends the wait: preempted)")
    memory: MemoryLevelConfig = Field(default_factory=MemoryLevelConfig)

    @model_validator(mode="before")
    @classmethod
    def _spelled_out(cls, data: Any) -> Any:
        return spelled_cadence(data, "every_seconds")

    @field_validator("url")
    @classmethod
    def _normalise_url(cls, url: str) -> str:
        refuse_a_path_in_rays_copy(url)
        url = absolute_url(url)
        protocol = url.partition("://")[0]
        if protocol not in EXCLUSIVE_CREATE:
            # Only one writer may commit a step or hold the job's lease (ckpt.storage.create_exclusive):
            # elsewhere a check-then-write would let two controllers both think they committed.
            raise ValueError(f"{url!r}: {protocol}:// has no exclusive create that undying uses, and commits and the "
                             "job's lease need one; use s3:// (also for Google Cloud Storage, through its "
                             "S3-compatible endpoint: storage_options {endpoint_url: https://storage.googleapis.com} "
                             "with HMAC keys), or a shared file system's path")
        return url

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
        # An object store's Python client holds the GIL for much of an upload: in a process of its own.
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
