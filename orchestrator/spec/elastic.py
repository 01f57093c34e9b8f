"""The `elastic:` section of the job spec: recovery limits, warm spares and the controller's timeouts.

Read by the controller (orchestrator.controller: recovery, stops, timeouts) from the validated
JobSpec; `orchestrator.spec.job_spec` holds the cross-section checks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from trainer.spec_section import SpecSection

# The auto hang limit's floor (orchestrator.controller.timeouts): no step for this long is a hang.
HANG_FLOOR_S = 10.0
# The auto first-step limit's floor, before anything is measured (gpu: torch's own NCCL default timeout).
FIRST_STEP_FLOOR_S = {"cpu": 120.0, "gpu": 600.0}


class ElasticConfig(SpecSection):
    """Recovery limits: dp may shrink to `min_dp`; `spares` standby ranks; `max_restarts` recoveries per
    `restart_window_s`."""

    min_dp: int = Field(1, ge=1, description="dp may shrink down to this many replicas while ranks are lost")
    # Spares are refilled in the background when one takes over (orchestrator.cluster.capacity).
    spares: int | Literal["auto"] = Field(
        "auto", description="warm standby ranks that take over a lost rank's seat; auto: one spare TP group (tp "
                            "seats) when the cluster has room for it, else none; 0: none. With tp > 1 give "
                            "whole TP groups: a spare never joins a TP group on another node")
    max_restarts: int = Field(10, ge=0, description="recoveries the job may make within elastic.restart_window_s "
                              "before it fails")
    # A rolling window (orchestrator.controller.policies.FailurePolicy): a multi-day job fails every few
    # hours as a matter of course, and a budget for the whole run would end a healthy one.
    restart_window_s: float | None = Field(86400.0, gt=0.0, description="max_restarts counts the recoveries of the "
                                           "failures noticed in the last this many seconds (a burst of failures "
                                           "stops the job, a long job failing every few hours keeps going), "
                                           "earlier runs of the job's too; null: every run's")
    replace_timeout_s: float = Field(60.0, ge=0.0, description="how long a lost rank's replacement may take to "
                                     "start before dp shrinks instead")
    grow: bool = Field(True, description="grow back to parallel.dp at a checkpoint boundary once replacements "
                                         "have started")
    crash_loop_limit: int = Field(3, ge=2, description="the same error at the same step on the same rank (any rank "
                                  "for the errors all ranks raise at once: a non-finite gradient, fp16's loss scale "
                                  "run out) this many times in a row stops the job")
    evict_stragglers: bool = Field(False, description="replace a rank flagged as a sustained straggler "
                                   "(monitor.straggler) by a warm spare (without one it stays: a new actor "
                                   "would start on the same device)")
    # Ray's stop delay is RAY_JOB_STOP_WAIT_TIME_S; Kubernetes' is terminationGracePeriodSeconds (30 s by default).
    preemption_grace_s: float = Field(25.0, gt=0.0, description="after SIGTERM/SIGINT, how long the job may take "
                                      "to checkpoint at the next step boundary and stop (exit 75); keep it below "
                                      "the platform's kill delay")
    # The controller's timeouts: a number of seconds, or `auto`, derived from what the job measures
    # (orchestrator.controller.timeouts; docs/design.md, timeouts).
    hang_timeout_s: float | Literal["auto"] = Field(
        "auto", description="no step for this long is a hang (ranks blocked on a checkpoint save that is "
        "writing, or on data reads their store fails, are not); auto: max(10 s, 5 x the median step)")
    first_step_timeout_s: float | Literal["auto"] = Field(
        "auto", description="a generation's first step (compilation, warm-up) may take this long; auto: 3 x the "
                            "slowest first step measured (at least 120 s on GPU: a warm compile cache may have "
                            "made it short), before any the cost model's step estimate x 20, at least 120 s on CPU "
                            "and 600 s on GPU")
    collective_timeout_s: float | Literal["auto"] = Field(
        "auto", description="the process group's timeout, the last resort behind the hang watchdog; auto: 2 x the "
                            "longer of the hang and first-step limits, at least 60 s, and for prepared datasets at "
                            "least data.read_retry_s + the hang limit")
    restore_timeout_s: float | Literal["auto"] = Field(
        "auto", description="how long the ranks' restore may take; auto: 180 s + checkpoint.read_retry_s + 3 x the "
                            "checkpoint's bytes over the read bandwidth (measured, else 100 MB/s per rank)")
    release_timeout_s: float | Literal["auto"] = Field(
        "auto", description="after a failure, how long a survivor may take to leave its step before it is killed; "
                            "auto: max(3 s, 2 x the median step), and during a generation's first step (which "
                            "may compile for minutes) what is left of the first step's limit if longer")

    @field_validator("hang_timeout_s", "first_step_timeout_s", "collective_timeout_s", "restore_timeout_s",
                     "release_timeout_s", mode="before")
    @classmethod
    def _seconds_or_auto(cls, value: Any, info: ValidationInfo) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{value!r} is not a timeout; give a number of seconds > 0, or 'auto' (derived "
                             "from the measured step time, docs/design.md)")
        watched = [(name, info.data.get(name)) for name in ("hang_timeout_s", "first_step_timeout_s")]
        shorter = [f"elastic.{name}={limit:g}" for name, limit in watched
                   if info.field_name == "collective_timeout_s" and isinstance(limit, float) and value <= limit]
        if shorter:
            raise ValueError(f"{value:g} s is not above {', '.join(shorter)}: a rank waiting in a collective would "
                             "time out before the watchdog finds the hung rank, and the wrong rank would be blamed; "
                             "raise it (or leave it auto)")
        return float(value)

    @property
    def least_hang_limit_s(self) -> float:
        """The shortest the hang limit can be: its explicit value, or auto's floor. The checks that
        other waits fit under it (heartbeats, data retries) take this."""
        return self.hang_timeout_s if isinstance(self.hang_timeout_s, float) else HANG_FLOOR_S

    @field_validator("spares", mode="before")
    @classmethod
    def _spares_count_or_auto(cls, value: Any) -> Any:
        # One message instead of the union's two (an int error and a literal error).
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError(f"{value!r} is not a number of spares; give a whole number >= 0 (0: no spare) "
                         "or 'auto' (one spare TP group when the cluster has room for it)")


def dp_refusal(spec, dp: int) -> str | None:
    """What rules out running the job at data-parallel degree `dp` (tp and pp fixed), naming its
    field; None when nothing does. The one judge of a smaller dp: the controller's ScalingPolicy asks
    it when a rank is lost, and `shrink_notes` before the job starts. A dp must be whole HSDP
    replicas, and the engine must take the layout there (trainer.layout_checks: a global batch that
    splits into whole microbatches per rank, a pipeline schedule's rounds, ...)."""
    from trainer.layout_checks import layout_refusals

    parallel, train = spec.parallel, spec.train
    if dp % parallel.dp_unit:
        return f"not whole replicas of {parallel.dp_unit} ranks (parallel.dp_replicate)"
    found = layout_refusals(spec.model, parallel.with_dp(dp), spec.data.seq_len, train.global_batch,
                            train.micro_batch, train.compile)
    return f"{found[0].key} ({found[0].field})" if found else None


def shrink_notes(spec) -> list[str]:
    """`elastic.min_dp` below `parallel.dp` says that the job shrinks when a rank is lost and nothing
    takes its place; when no dp from dp - 1 down to min_dp runs (`dp_refusal`), it never can, and a
    lost rank without a spare or a replacement fails the job: a note the driver prints before it
    starts (such a job runs as min_dp = dp would)."""
    parallel, elastic = spec.parallel, spec.elastic
    if parallel.mode == "ps" or elastic.min_dp >= parallel.dp:
        return []  # (a parameter-server job replaces workers; it does not shrink)
    reasons = [dp_refusal(spec, dp) for dp in range(parallel.dp - 1, elastic.min_dp - 1, -1)]
    if any(why is None for why in reasons):
        return []
    lower = next((dp for dp in range(elastic.min_dp - 1, 0, -1) if dp_refusal(spec, dp) is None), None)
    fix = f"set it to {parallel.dp} to say so" + (f", or to {lower}, the largest smaller dp that runs" if lower else "")
    return [f"elastic.min_dp: {elastic.min_dp} lets the job shrink below parallel.dp = {parallel.dp}, but no dp from "
            f"{parallel.dp - 1} down to {elastic.min_dp} runs ({reasons[0]}), so it never shrinks: a lost rank "
            f"that no spare or replacement takes over fails the job; {fix}"]


def timeout_problems(elastic, data, checkpoint, resources, mode: str = "collective") -> list:
    """Explicit controller timeouts shorter than a wait another section allows: the wait would run
    into the limit, and a rank be blamed (a collective timeout, a failed restore) for what the spec
    lets happen. `auto` derives each from the others (orchestrator.controller.timeouts)."""
    from orchestrator.spec.problems import Problem

    if not elastic:
        return []
    out, collective = [], elastic.collective_timeout_s
    if isinstance(collective, float) and mode != "ps":  # (ps refuses the field: it forms no process group)
        hang = elastic.least_hang_limit_s
        if data and data.source == "tokens" and collective <= data.read_retry_s + hang:
            out.append(Problem("elastic.collective_timeout_s", f"{collective:g} s is not above data.read_retry_s + "
                               f"the hang limit ({data.read_retry_s:g} + {hang:g} s): a rank waiting out its data "
                               "store's outage, as data.read_retry_s lets it, would time its peers' collectives out "
                               "first and be blamed; raise it (or leave it auto), or lower data.read_retry_s"))
        device = "gpu" if resources and resources.gpus_per_rank > 0 else "cpu"
        floor = FIRST_STEP_FLOOR_S[device]
        if elastic.first_step_timeout_s == "auto" and collective <= floor:
            out.append(Problem("elastic.collective_timeout_s", f"{collective:g} s is not above the automatic "
                               f"first-step limit, at least {floor:g} s on {device}: a first step that compiles or "
                               "warms up longer would time out in its first collective, blamed on a rank; raise it "
                               "(or leave it auto), or set elastic.first_step_timeout_s below it"))
    restore = elastic.restore_timeout_s
    if isinstance(restore, float) and checkpoint and restore <= checkpoint.read_retry_s:
        out.append(Problem("elastic.restore_timeout_s", f"{restore:g} s is not above checkpoint.read_retry_s "
                           f"({checkpoint.read_retry_s:g} s): a restore waiting out its store's failures, as that "
                           "lets it, would run into this limit and be blamed on a rank instead of failing naming the "
                           "checkpoint; raise it (or leave it auto), or lower checkpoint.read_retry_s"))
    return out
