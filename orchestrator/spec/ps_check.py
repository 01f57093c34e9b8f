"""The job spec's checks of parameter-server mode (`parallel.mode: ps`, paramserver/).

Called by `orchestrator.spec.job_spec.cross_section_problems` with a JobSpec or a partial view
of one (a section that failed its own validation is None, and the checks that need it are
skipped). Each problem names the field to change and why the mode refuses it today. Before that,
`ps_defaults` fills in the mode's own defaults (JobSpec's before-validator, on the raw data).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chaos.config import SERVER_KINDS
from orchestrator.spec.problems import Problem

# Fields of `parallel:` that only parameter-server mode reads, with their defaults. A default is
# accepted in collective mode (a spec's canonical JSON names every field); another value is not.
PS_DEFAULTS = {"servers": 1, "consistency": "bsp", "staleness": None}


def ps_defaults(data: Any) -> Any:
    """Raw spec data (before validation) with parameter-server mode's own defaults filled in where
    a `parallel.mode: ps` spec leaves them unset: its supervisor waits at each segment boundary for
    the commit (`checkpoint.async: false`) and keeps no memory snapshots (`checkpoint.memory.enabled:
    false`), where the collective defaults are a background save and the memory level on. A value
    the spec sets is kept, and refused by `ps_problems` when the mode cannot run it."""
    if not isinstance(data, Mapping) or _mode(data.get("parallel")) != "ps":
        return data
    ckpt = data.get("checkpoint")
    if not isinstance(ckpt, Mapping):
        return data
    memory = ckpt.get("memory", {})
    filled = {**ckpt} if "async" in ckpt or "async_" in ckpt else {**ckpt, "async": False}
    if isinstance(memory, Mapping) and "enabled" not in memory:
        filled["memory"] = {**memory, "enabled": False}
    return {**data, "checkpoint": filled}


def _mode(parallel: Any) -> Any:
    return parallel.get("mode") if isinstance(parallel, Mapping) else getattr(parallel, "mode", None)


def ps_problems(spec: Any) -> list[Problem]:
    par, train = spec.parallel, spec.train
    if not par:
        return []
    if par.mode != "ps":
        on_servers = [(i, f.kind) for i, f in enumerate(getattr(getattr(spec, "chaos", None), "faults", None) or ())
                      if f.kind in SERVER_KINDS]
        return [Problem(f"parallel.{name}", f"is read only with parallel.mode ps (this job's mode is "
                        f"{par.mode}); remove it or set parallel.mode: ps")
                for name, default in PS_DEFAULTS.items() if getattr(par, name) != default] + [
                Problem(f"chaos.faults[{i}].kind", f"{kind} acts on a parameter server, which only parallel.mode "
                        "ps has; use kill_rank or hang_rank, or set parallel.mode: ps") for i, kind in on_servers]
    out = []
    if par.consistency == "ssp" and par.staleness is None:
        out.append(Problem("parallel.staleness", "consistency ssp needs a bound: set parallel.staleness to the "
                           "steps a worker may run ahead of the slowest (0 waits like bsp)"))
    if par.consistency != "ssp" and par.staleness is not None:
        out.append(Problem("parallel.staleness", f"is read only with consistency ssp (this job's is "
                           f"{par.consistency}); remove it or set parallel.consistency: ssp"))
    # Each refusal: the server shards are whole-model slices and each worker runs one whole
    # model in one process, so no layout inside a worker exists yet.
    for name, allowed, why in (("tp", 1, "a worker is one process holding the whole model"),
                               ("pp", 1, "a worker is one process holding the whole model"),
                               ("zero", 0, "the servers already own the optimizer state, sharded"),
                               ("dp_replicate", 1, "workers form no replicas")):
        value = getattr(par, name)
        if value != allowed:
            out.append(Problem(f"parallel.{name}", f"{value} is not supported with parallel.mode ps ({why}); "
                               f"set parallel.{name}: {allowed}"))
    if train and train.grad_clip is not None:
        out.append(Problem("train.grad_clip", f"{train.grad_clip}: clipping by the global gradient norm needs "
                           "every shard's gradient in one place, which parallel.mode ps does not have yet; "
                           "set train.grad_clip: null"))
    chaos, evaluation = getattr(spec, "chaos", None), getattr(spec, "eval", None)
    if chaos:
        out += chaos_problems(chaos, par.servers)
    if evaluation:
        out.append(Problem("eval", "parallel.mode ps does not evaluate during training yet; remove the eval "
                           "section (or evaluate a collective job's checkpoint with `undying eval`)"))
    if train and train.precision != "fp32":
        out.append(Problem("train.precision", f"{train.precision} is not supported with parallel.mode ps yet "
                           "(workers compute and servers update in fp32); set train.precision: fp32"))
    return out + _checkpoint_problems(getattr(spec, "checkpoint", None)) \
        + _elastic_problems(getattr(spec, "elastic", None)) + _unread_problems(spec)


def _unread_problems(spec: Any) -> list[Problem]:
    """What the supervisor does not honour yet, refused rather than dropped without a word: each worker
    and server is one actor of one CPU (paramserver.job), and the driver serves its Prometheus series
    and writes its report, no tracker's scalars."""
    out = []
    resources, monitor = getattr(spec, "resources", None), getattr(spec, "monitor", None)
    if resources:
        one_cpu = "each worker and server is one actor of one CPU"
        out += _off_default(resources, dict.fromkeys(("cpus_per_rank", "gpus_per_rank", "custom", "placement"),
                                                     one_cpu), "resources")
    train, par = getattr(spec, "train", None), getattr(spec, "parallel", None)
    if train and train.compile:
        out.append(Problem("train.compile", "is not applied by parallel.mode ps (its workers run the model "
                           "eagerly); remove it"))
    if par:
        out += _off_default(par, {"recompute": "its workers keep every activation",
                                  "ddp_bucket_mb": "its workers push to servers, no all-reduce"}, "parallel")
    for name in ("tensorboard", "wandb"):
        if monitor and getattr(monitor, name) is not None:
            out.append(Problem(f"monitor.{name}", "parallel.mode ps logs no tracker scalars yet (its losses, goodput "
                               "and staleness are in its report, --report, and its Prometheus series); remove it"))
    return out


def _checkpoint_problems(ckpt: Any) -> list[Problem]:
    """A PS job saves at its supervisor's segment boundaries, every checkpoint.every_steps steps, and
    waits for the commit (paramserver.checkpoint); what it does not run is refused."""
    if not ckpt:
        return []
    out = []
    if ckpt.every_steps is None:
        out.append(Problem("checkpoint.every_steps", "parallel.mode ps checkpoints between segments of a fixed "
                           "number of steps, not at a measured interval (interval, every_seconds); set "
                           "checkpoint.every_steps: N"))
    if ckpt.async_:
        out.append(Problem("checkpoint.async", "parallel.mode ps waits at the segment boundary until every server's "
                           "shard is written and the checkpoint committed (no background save); set "
                           "checkpoint.async: false"))
    if ckpt.memory.enabled:
        out.append(Problem("checkpoint.memory.enabled", "parallel.mode ps keeps no in-memory snapshots (its servers "
                           "restore from storage checkpoints); set checkpoint.memory.enabled: false"))
    return out + _off_default(ckpt, PS_UNREAD_CHECKPOINT, "checkpoint")


# The elastic fields parameter-server mode does not read, with why. It reads max_restarts,
# restart_window_s and crash_loop_limit (paramserver.restart_budget), the hang and first-step timeouts
# (paramserver.hang_watch), the restore timeout (paramserver.restores) and preemption_grace_s
# (paramserver.preemption).
PS_UNREAD_ELASTIC = {
    "min_dp": "a ps job keeps its dp workers: a lost worker is replaced, never dropped",
    "spares": "a ps job starts a new actor for a lost worker or server; it keeps no warm spares",
    "replace_timeout_s": "a ps job has no smaller layout to fall back on; a replacement that does not start is "
                         "found by elastic.first_step_timeout_s",
    "grow": "nothing shrinks in parallel.mode ps, so nothing grows back",
    "evict_stragglers": "parallel.mode ps does not evict stragglers; ssp and asp bound what a straggler costs",
    "collective_timeout_s": "a ps job has no process group: its workers and servers talk by Ray actor calls",
    "release_timeout_s": "a ps rollback aborts the servers, which ends every worker's run",
}


# The checkpoint fields it does not read (the rest of what it does not run: _checkpoint_problems).
PS_UNREAD_CHECKPOINT = {
    "commit_timeout_s": "its manifest create runs on the supervisor's thread at the segment boundary, under no "
                        "limit of its own; elastic.restore_timeout_s limits the servers' writes of a save",
}


def _elastic_problems(elastic: Any) -> list[Problem]:
    if not elastic:
        return []
    return [p for p in _off_default(elastic, PS_UNREAD_ELASTIC, "elastic")
            if not (p.field == "elastic.spares" and elastic.spares == 0)]


def _off_default(section: Any, unread: dict[str, str], prefix: str) -> list[Problem]:
    """One problem per field of `unread` (name -> why ps mode does not read it) that `section` sets away
    from its default."""
    fields = type(section).model_fields
    return [Problem(f"{prefix}.{name}", f"is not read by parallel.mode ps ({why}); remove it")
            for name, why in unread.items()
            if getattr(section, name) != fields[name].get_default(call_default_factory=True)]


# What the parameter-server supervisor (paramserver.supervisor) injects: a worker's or a server's
# death at a step, or a worker's hang (it stops, alive). The rest acts inside the controller's rank
# actors or on their checkpoint writes.
PS_FAULT_KINDS = ("kill_rank", "hang_rank", "kill_server", "hang_server")


def chaos_problems(chaos: Any, servers: int) -> list[Problem]:
    """The faults a ps job can inject: kill_rank and hang_rank (rank = worker index), kill_server and
    hang_server, each at_step only and once; random failures (mtbf_s) are refused."""
    out = []
    if chaos.mtbf_s is not None:
        out.append(Problem("chaos.mtbf_s", "parallel.mode ps injects scripted faults only (kill_rank, hang_rank, "
                           "kill_server, hang_server at a step); remove mtbf_s"))
    for i, fault in enumerate(chaos.faults):
        where = f"chaos.faults[{i}]"
        if fault.kind not in PS_FAULT_KINDS:
            out.append(Problem(f"{where}.kind", f"{fault.kind} is not injected in parallel.mode ps; use kill_rank "
                               "or hang_rank (rank: the worker), kill_server or hang_server (server: the shard), "
                               "or parallel.mode collective"))
            continue
        if fault.kind in SERVER_KINDS and fault.server >= servers:
            out.append(Problem(f"{where}.server", f"{fault.server} is not a server of this job (parallel.servers = "
                               f"{servers}); use a server in 0..{servers - 1}"))
        for name in ("at_point", "at_seconds", "node", "rank" if fault.kind in SERVER_KINDS else None):
            if name and getattr(fault, name) is not None:
                out.append(Problem(f"{where}.{name}", f"{fault.kind} in parallel.mode ps is fired by the supervisor "
                                   f"at a step; remove {name} and give at_step: <k>"))
        if fault.at_step is None:
            out.append(Problem(f"{where}.at_step", f"{fault.kind} in parallel.mode ps needs at_step: <k> (the step "
                               "the worker is about to pull, or the step every worker has pushed to the server)"))
        if fault.repeat:
            out.append(Problem(f"{where}.repeat", f"{fault.kind} in parallel.mode ps fires once; remove repeat"))
    return out
