"""The job spec: one typed, validated description of a training job, loaded from YAML.

Protocol: the driver (the `undying` CLI, on the machine the user runs it from) calls
`load_spec(path, overrides)` once, then `orchestrator.spec.storage_check.require_storage(spec)`,
before any rank starts; every later component receives the `JobSpec` object and trusts it.
Any user mistake surfaces as one `SpecError` that lists every problem found, each naming
the dotted field (`parallel.tp`, `chaos.faults[0].rank`) and saying how to fix it.

Sections are checked on their own by their models (trainer/, ckpt/, chaos/, monitor/);
checks that need two sections (heads % tp, batch divisibility, ...) run here, all of them,
so a user fixes a spec in one round rather than one error at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from chaos.config import CHECKPOINT_POINTS, STORAGE_KINDS, ChaosConfig
from ckpt.config import CheckpointConfig
from monitor.config import MonitorConfig
from orchestrator.spec.elastic import ElasticConfig, timeout_problems
from orchestrator.spec.memory_check import memory_level_problems
from orchestrator.spec.problems import Problem, SpecError
from orchestrator.spec.ps_check import ps_defaults, ps_problems
from orchestrator.spec.secrets import STORAGE_SECTIONS, resolve_storage_files
from orchestrator.spec.validation_errors import keys_of, model_in, problems_from_validation_error
from orchestrator.spec.yaml_input import apply_overrides
from orchestrator.spec.yaml_loader import UniqueKeyLoader, yaml_reason
from trainer.config import DataConfig, EvalConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.spec_section import SpecSection


class ResourcesConfig(SpecSection):
    """What one rank asks Ray for; `num_ranks`, when given, must equal dp * tp * pp."""

    cpus_per_rank: float = Field(1.0, gt=0.0, description="CPUs Ray reserves for each rank")
    gpus_per_rank: float = Field(0.0, ge=0.0, description="GPUs per rank: 1 on GPU jobs, 0 on CPU")
    num_ranks: int | None = Field(None, gt=0, description="a check: when given, must equal parallel.dp * tp * pp")
    custom: dict[str, Annotated[float, Field(ge=0.0)]] = Field(
        default_factory=dict, description="extra Ray resources per rank, e.g. {accelerator_type:H100: 1}"
    )
    placement: Literal["pack", "spread"] = Field(
        "pack", description="each TP group is one bundle on one node; pack puts the groups on few nodes, "
                            "spread puts DP replicas and PP stages on as many nodes as possible"
    )

    @field_validator("custom", mode="after")
    @classmethod
    def _not_cpus_or_gpus(cls, custom: dict[str, float]) -> dict[str, float]:
        taken = sorted(name for name in custom if name in ("CPU", "GPU"))
        if taken:  # Ray refuses them as custom resources (a traceback at placement)
            raise ValueError(f"{', '.join(taken)} is not a custom resource; give it as resources.cpus_per_rank or "
                             "resources.gpus_per_rank")
        return custom

    @field_validator("gpus_per_rank", mode="after")
    @classmethod
    def _whole_gpus(cls, gpus: float) -> float:
        # Ray grants fractions of a GPU, so two ranks would share one device (its memory and its
        # compute), which the engine's memory plan and NCCL's one-rank-per-device rule do not allow.
        if gpus != int(gpus):
            raise ValueError(f"{gpus:g} is a fraction of a GPU: two ranks would share one GPU; give a whole "
                             "number (1: one GPU per rank, 0: CPU ranks)")
        if gpus > 1:  # a rank drives one device: the others it reserved would sit idle
            raise ValueError(f"{gpus:g} GPUs per rank: each rank drives one GPU, so the others would sit idle; "
                             "give 1 and raise parallel.dp, tp or pp to use more GPUs")
        return gpus


# Fault kinds whose at_step names a checkpoint step (up to and including train.steps, the final save).
CHECKPOINT_STEP_KINDS = STORAGE_KINDS | {"corrupt_shard"}
MAX_NAME, _SAFE_NAME = 128, re.compile(r"[A-Za-z0-9._-]+")
# What a job's root holds beside its step-<9 digits> directories (ckpt.owner_claims.OWNER_DIR,
# monitor.event_log.EVENTS_DIR, the controller's goodput snapshot and chaos marker, the CLI's chaos
# experiment marker): a job named so, whose checkpoint.url is another job's root, would be read as
# that job's own entry (an unfinished save its retention deletes, or its lease).
ROOT_ENTRIES = ("owner", "events", "goodput.json", "chaos", "chaos-experiment.json")
_STEP_NAME = re.compile(r"step-\d{9}")


class JobSpec(SpecSection):
    """A whole job. Cross-section checks run when it is built, so a JobSpec is always valid."""

    name: str = Field(..., description="the job's name: its checkpoints live under <checkpoint.url>/<name>, so "
                      "it must be a safe directory name")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    eval: EvalConfig | None = None

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        # The name becomes a directory under checkpoint.url, so it must be one safe path
        # component: no separators, no spaces, and not "." or "..".
        if not _SAFE_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"{name!r} is not a safe directory name; use letters, digits, '.', '_' "
                             "and '-' only, e.g. 'llama-1b.run3'")
        if name in ROOT_ENTRIES or _STEP_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is a name a job's checkpoint root uses for its own entries; choose another")
        if len(name) > MAX_NAME:  # a file system's name holds 255 bytes; labels and run names less
            raise ValueError(f"{len(name)} characters; a job name is at most {MAX_NAME}: shorten it")
        return name

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data: Any) -> Any:
        return ps_defaults(data)

    @model_validator(mode="after")
    def _cross_section(self) -> JobSpec:
        problems = cross_section_problems(self) + engine_support_problems(self)
        if problems:
            # Raised as a ValidationError so that pydantic reports every problem at its own
            # field, the same way as the per-section errors.
            raise ValidationError.from_exception_data("JobSpec", [_line_error(p) for p in problems])
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def checkpoint_root(self) -> str:
        """Where this job's checkpoints live: `<checkpoint.url>/<name>`."""
        return self.checkpoint.join(self.name)


def _line_error(problem: Problem) -> InitErrorDetails:
    loc = tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]\.?", problem.field) if p)
    # The message goes in the context, not the template, so braces in it are not formatted.
    error = PydanticCustomError("spec", "{message}", {"message": problem.message})
    return InitErrorDetails(type=error, loc=loc, input=None)


def cross_section_problems(spec: Any) -> list[Problem]:
    """Every layout and consistency problem that needs more than one section.

    `spec` is a JobSpec, or a view of one whose invalid sections are None (see
    `validate_spec`); a check that needs a missing section is skipped, so layout problems
    are reported in the same round as typos elsewhere in the spec."""
    model, data, train, par = spec.model, spec.data, spec.train, spec.parallel
    out = _layout_problems(par, spec.resources) + memory_level_problems(spec) + ps_problems(spec) \
        + _heartbeat_problems(spec.monitor, spec.elastic) + _mixture_problems(data, train)
    if model and data and data.source == "text" and model.vocab_size < 256:
        out.append(Problem("model.vocab_size", f"{model.vocab_size} is too small for data.source 'text', "
                           "which tokenizes bytes (256 ids); set model.vocab_size to at least 256"))
    if model and data and model.from_hf and "source" not in data.model_fields_set:
        out.append(Problem("data.source", f"is not given, so the weights of model.from_hf ({model.from_hf}) would be "
                           "fine-tuned on synthetic tokens; give a prepared dataset (source: tokens, path: the "
                           "output of `undying data prepare ... --tokenizer` that directory), or write source: "
                           "synthetic to train on synthetic tokens on purpose"))
    if data and getattr(spec, "eval", None) is not None and data.source == "text":
        out.append(Problem("eval.path", "is a dataset prepared with a tokenizer, and data.source 'text' trains on "
                           "bytes as ids 0-255: the validation loss would measure other words behind the same ids; "
                           "train on prepared data (source: tokens, the same tokenizer) or remove eval"))
    eval_len = eval_length(spec)
    if model and eval_len and eval_len > model.max_seq_len:
        out.append(Problem("eval.seq_len", f"{eval_len} exceeds model.max_seq_len = {model.max_seq_len}; "
                           "evaluate shorter windows"))
    if par and spec.elastic and spec.elastic.min_dp > par.dp:
        out.append(Problem("elastic.min_dp", f"{spec.elastic.min_dp} exceeds parallel.dp = {par.dp}; "
                           f"set it to at most {par.dp}"))
    out += timeout_problems(spec.elastic, data, spec.checkpoint, spec.resources, par.mode if par else "collective")
    for i, fault in enumerate(spec.chaos.faults if spec.chaos else ()):
        if par and fault.rank is not None and fault.rank >= par.world_size:
            out.append(Problem(f"chaos.faults[{i}].rank", f"{fault.rank} is not a rank of this job (dp * tp"
                               f" * pp = {par.world_size} ranks); use a rank in 0..{par.world_size - 1}"))
        # A storage fault's or corrupt_shard's at_step names a checkpoint, and the last one is train.steps.
        names_checkpoint = (fault.kind in CHECKPOINT_STEP_KINDS and fault.target != "data") \
            or fault.at_point in CHECKPOINT_POINTS
        last = train.steps if train and names_checkpoint else (train.steps - 1 if train else 0)
        if train and fault.at_step is not None and fault.at_step > last:
            out.append(Problem(f"chaos.faults[{i}].at_step", f"{fault.at_step} is not before train.steps "
                               f"= {train.steps}" + (" (nor that final checkpoint)" if last == train.steps else "")
                               + f", so it never fires; use a step in 0..{last}"))
        if data and fault.target == "data" and data.source != "tokens":
            out.append(Problem(f"chaos.faults[{i}].target", f"data faults act on the reads of a prepared dataset "
                               f"(data.source: tokens); this job's data.source is {data.source!r}, so it would "
                               "never fire: remove the fault or train from a prepared dataset"))
        # in_allreduce fires in DDP's gradient all-reduce (trainer.data_parallel), which only dp > 1
        # with ZeRO 0/1 runs; elsewhere the point is never reached and the fault would never fire.
        if par and fault.at_point == "in_allreduce" and (par.dp == 1 or par.zero >= 2):
            out.append(Problem(f"chaos.faults[{i}].at_point", f"in_allreduce is DDP's gradient all-reduce, which "
                               f"this layout (dp = {par.dp}, zero = {par.zero}) does not run; use dp > 1 with "
                               "zero 0 or 1, or another point such as after_backward"))
    return out


def _mixture_problems(data: Any, train: Any) -> list[Problem]:
    """Weights the samples can be dealt by (trainer.tokens.windows): a finite total, and no dataset
    whose share of the run's samples is under one (it would never be read, without a word)."""
    if not (data and data.mixture):
        return []
    total = sum(part.weight for part in data.mixture)
    if not math.isfinite(total):
        return [Problem("data.mixture", f"the weights add up to {total}; give finite relative shares, e.g. 0.7 "
                                        "and 0.3")]
    samples = train.steps * train.global_batch if train else 0
    return [Problem(f"data.mixture[{i}].weight", f"{part.weight:g} of {total:g} is a share of "
                    f"{part.weight / total:.3g}, under one of the run's {samples} samples (train.steps x "
                    "train.global_batch): the dataset would never be read; raise its weight or drop it")
            for i, part in enumerate(data.mixture) if samples and part.weight / total * samples < 1]


def _heartbeat_problems(monitor: Any, elastic: Any) -> list[Problem]:
    """A rank busy in a long save or a slow read shows it by its beats, read at most every
    monitor.heartbeat_s: beats that far apart, against the hang limit, make that rank look hung."""
    if not (monitor and elastic):
        return []
    limit = elastic.least_hang_limit_s
    if monitor.heartbeat_s * 2 <= limit:
        return []
    return [Problem("monitor.heartbeat_s", f"{monitor.heartbeat_s:g} s is over half the hang limit "
                    f"({limit:g} s): a rank busy in a long save or a slow read would look hung between its beats; "
                    f"set it to at most {limit / 2:g} s (or raise elastic.hang_timeout_s)")]


def _layout_problems(par: Any, resources: Any) -> list[Problem]:
    out: list[Problem] = []
    if par and resources and resources.num_ranks not in (None, par.world_size):
        out.append(Problem("resources.num_ranks", f"{resources.num_ranks} does not match parallel.dp * "
                           f"tp * pp = {par.world_size}; set it to {par.world_size} or leave it out"))
    return out


def engine_support_problems(spec: Any) -> list[Problem]:
    """What the engine refuses to run: trainer.layout_checks.layout_refusals, the one function
    the engine and `undying plan` call too (tp splits, sequence length, batch, pipeline
    schedule x ZeRO x chunks x microbatches), each on its field. `spec` may be a partial
    view, as above: a refusal whose section is missing is not checked."""
    par, data, model, train = spec.parallel, spec.data, spec.model, spec.train
    if not (par and model):
        return []
    # imported here only, because it needs torch
    from trainer.layout_checks import layout_refusals

    found = layout_refusals(model, par, data.seq_len if data else None, train.global_batch if train else None,
                            train.micro_batch if train else None, bool(train and train.compile), eval_length(spec))
    return [Problem(refusal.field, refusal.message) for refusal in found]


def eval_length(spec) -> int | None:
    """The validation windows' length (eval.seq_len, else data.seq_len); None without validation."""
    evaluation, data = getattr(spec, "eval", None), getattr(spec, "data", None)
    return (evaluation.seq_len or (data.seq_len if data else None)) if evaluation else None


def _valid_sections(data: Mapping[str, Any]) -> SimpleNamespace:
    """Each section of `data` that passes its own checks; None for the others."""
    view: dict[str, Any] = {}
    data = ps_defaults(data)
    for key, info in JobSpec.model_fields.items():
        model, view[key] = model_in(info.annotation), None
        if model is None or (key not in data and info.is_required()):
            continue
        with contextlib.suppress(ValidationError):  # already reported by the whole-spec validation
            value = data[key] if key in data else info.get_default(call_default_factory=True)
            view[key] = model.model_validate(value)
    return SimpleNamespace(**view)


def validate_spec(data: Mapping[str, Any], base_dir: str | None = None) -> JobSpec:
    """Build a JobSpec from plain data (parsed YAML); raise SpecError listing every problem.

    Each section's `storage_options_file` (relative to `base_dir`, else the working directory)
    is read into its `storage_options` first (orchestrator.spec.secrets).
    When some sections are invalid, pydantic never reaches the cross-section checks, so
    they are run again on the sections that are valid: one round reports everything."""
    problems: list[Problem] = []
    if isinstance(data, Mapping):
        data, problems = resolve_storage_files(data, base_dir)
    try:
        spec = JobSpec.model_validate(data)
        if not problems:
            return spec
        raise SpecError(problems)
    except ValidationError as error:
        problems += problems_from_validation_error(error, JobSpec)
    if isinstance(data, Mapping):
        view = _valid_sections(data)
        more = cross_section_problems(view) + engine_support_problems(view)
        problems += [p for p in more if p not in problems]
    raise SpecError(problems)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as error:
        reason = "not UTF-8 text" if isinstance(error, UnicodeDecodeError) else error.strerror
        raise SpecError([Problem(path, f"cannot be read ({reason}); give the path of a UTF-8 YAML job "
                                 "spec")]) from None
    except yaml.YAMLError as error:
        raise SpecError([Problem(path, f"{yaml_reason(error)}; fix the YAML syntax")]) from None
    if not isinstance(data, dict):
        got = "empty" if data is None else f"a {type(data).__name__}"
        raise SpecError([Problem(path, f"the top level is {got}, not a mapping; a job spec maps keys "
                                 f"{', '.join(keys_of(JobSpec))} to their sections")])
    return data


def load_spec(path: str, overrides: Sequence[str] = ()) -> JobSpec:
    """Read the YAML job spec at `path`, apply `--set` overrides, validate; raise SpecError."""
    return validate_spec(apply_overrides(_read_yaml(path), overrides), os.path.dirname(os.path.abspath(path)))


# Left out of the hash: storage options hold credentials, and the hash is written into every
# manifest. They say where the bytes live and how to reach them, not what the job computes, so a
# job resumes after its endpoint moves or its keys rotate (the manifest sits in the store itself).
HASH_EXCLUDED = {section: {"storage_options"} for section in STORAGE_SECTIONS}


def spec_hash(spec: JobSpec) -> str:
    """Stable sha256 (hex) of the spec's canonical JSON: sorted keys, no whitespace, YAML
    key spellings, without HASH_EXCLUDED. Equal specs hash equally across processes and
    Python versions."""
    canonical = json.dumps(spec.model_dump(mode="json", by_alias=True, exclude=HASH_EXCLUDED), sort_keys=True,
                           separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
