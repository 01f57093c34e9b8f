"""Before a job trains on a root that holds committed checkpoints: does this spec resume them?

Called by `undying run` (orchestrator.cli.run, orchestrator.cli.ps_run) once it holds the root's
lease, before any rank exists: `refused_resume(spec)`; `resume_problems(spec, catalog)` reads the newest committed
manifest and returns a Problem for each key of the spec that would make its restore wrong or
impossible. The manifest carries the model's architecture and the engine's trajectory keys and data
identity (trainer.data.data_identity: the source, seq_len, each prepared dataset's weight and
content); the ranks check the same keys again on the step they restore (trainer.checkpoint_match),
but there a refusal costs a cluster's start-up and fails the job. Unchecked, a model with fewer
blocks or untied embeddings would restore the tensors it still names and train on, and once `keep`
new commits landed, retention would have deleted the old model.

A manifest that does not read is left to the restore, which says why, falls back, and checks the
step it loads.
"""

from __future__ import annotations

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from orchestrator.cli.exits import print_problems
from orchestrator.spec.problems import Problem
from trainer.checkpoint_match import model_differences
from trainer.data import data_identity

# The engine state's keys that fix the training trajectory (trainer.engine_state._check_meta).
TRAJECTORY = {"global_batch": "train.global_batch", "optimizer": "train.optimizer", "data_seed": "data.seed"}
FIX = "resume with the spec the checkpoints were trained with, or start the new model under another name " \
      "(--set name=...)"


def refused_resume(spec) -> bool:
    """Whether the root's committed checkpoints refuse `spec` (the problems printed): `undying run`
    then exits 2."""
    problems = resume_problems(spec, Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options)))
    if problems:
        print_problems(problems)
    return bool(problems)


def resume_problems(spec, catalog: Catalog) -> list[Problem]:
    try:
        steps = catalog.committed_steps()
        state = catalog.read_manifest(steps[-1]).state if steps else None
    except Exception:  # noqa: BLE001 (unreadable or the store failing: the restore reads it again, and says why)
        return []
    if state is None:
        return []
    where = f"{catalog.storage.root} step {steps[-1]}"
    engine = state.get("engine")
    return (_model_problems(spec, state.get("model"), where) + _weights_problems(spec, state, where)
            + _trajectory_problems(spec, engine, where) + _data_problems(spec, engine, where))


def _model_problems(spec, saved: dict | None, where: str) -> list[Problem]:
    return [Problem(f"model.{key}", f"the committed checkpoints ({where}) are of a model with {key}={theirs!r}, "
                                    f"this spec gives {ours!r}; {FIX}")
            for key, theirs, ours in model_differences(saved, spec.model.architecture())]


def _weights_problems(spec, state: dict, where: str) -> list[Problem]:
    """Initial weights (`model.from_hf`) other than the checkpoints started from: a resume never reads
    them, so the spec would train on from the old weights without a word (ckpt.hf_identity)."""
    from ckpt.hf_identity import UNKNOWN, weights_provenance

    if "from_hf" not in state or state["from_hf"] == UNKNOWN or not spec.model.from_hf:
        return []  # (older checkpoints; weights unread then; a spec that names none resumes what is there)
    here = weights_provenance(spec.model)["from_hf"]
    if here in (UNKNOWN, state["from_hf"]):
        return []
    started = "were trained from scratch, not from" if state["from_hf"] is None else "started from other weights than"
    return [Problem("model.from_hf", f"the committed checkpoints ({where}) {started} those {spec.model.from_hf} "
                                     "holds, which a resume never reads: resume without model.from_hf or with the "
                                     "weights they started from, or fine-tune these under another name "
                                     "(--set name=...)")]


def _trajectory_problems(spec, engine: dict | None, where: str) -> list[Problem]:
    if not isinstance(engine, dict):
        return []
    here = {"global_batch": spec.train.global_batch, "optimizer": spec.train.optimizer, "data_seed": spec.data.seed,
            "train_seed": spec.train.seed}
    # After a restore train.seed draws only the dropout masks: another seed changes nothing without dropout.
    keys = {**TRAJECTORY, **({"train_seed": "train.seed"} if spec.model.dropout > 0 else {})}
    return [Problem(field, f"the committed checkpoints ({where}) were trained with {engine[key]!r}, this spec gives "
                           f"{here[key]!r}: resuming would change the training trajectory; {FIX}")
            for key, field in keys.items() if key in engine and engine[key] != here[key]]


def _data_problems(spec, engine: dict | None, where: str) -> list[Problem]:
    """Other data (a source, path, mixture weight, seq_len or prepared dataset's content) than the
    checkpoints were trained on: the resume would repeat some samples and skip others."""
    saved = engine.get("data") if isinstance(engine, dict) else None  # absent from older checkpoints
    if saved is None:
        return []
    try:
        here = data_identity(spec.data, spec.model.vocab_size)
    except Exception:  # noqa: BLE001 (unreadable here: require_data said why, or the ranks will)
        return []
    if saved == here:
        return []
    what = ", ".join(key for key in sorted(set(saved) | set(here)) if saved.get(key) != here.get(key))
    return [Problem("data", f"the committed checkpoints ({where}) were trained on other data (their {what} "
                            "differ from this spec's data section): resuming would repeat some samples and skip "
                            "others; resume with the data they were trained on (source, path or mixture and its "
                            "weights, seq_len, the same prepared datasets), or train on the new data under "
                            "another name (--set name=...)")]
