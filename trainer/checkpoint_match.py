"""Whether a committed checkpoint belongs to the spec that resumes it: the same model, trajectory, data.

Two places ask, with the same keys: the driver before any rank exists (orchestrator.cli.resume_check,
on the newest manifest, to refuse the spec up front) and every restoring rank on the manifest of the
step it actually loads (orchestrator.rank.state.load_engine_state for the model here,
trainer.engine_state for the trajectory and data), since the driver's read may have failed, and
a restore may fall back to an older step. The rank's refusal is a `CheckpointMismatch`, which the
controller takes as final (the job fails, deleting nothing): a restore retried would refuse again.
"""

from __future__ import annotations

from typing import Any

# Keys that decide which tensors the model has and what they mean: a change of one of them is
# another model. The others (rope_theta, rope_scaling, dropout, norm_eps, max_seq_len with rotary
# positions) are knobs a run may turn when it resumes, e.g. to extend its context. A restore cannot
# tell by itself: it loads the tensors the model names, so fewer blocks or a tied head load a
# part of the checkpoint, and other heads of the same width load every tensor, cut anew.
STRUCTURAL = ("vocab_size", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_ff", "activation", "position",
              "norm", "tie_embeddings")


class CheckpointMismatch(ValueError):
    """A checkpoint of another model, trajectory or data than the spec restoring it: final, not retried."""


def model_differences(saved: Any, here: dict) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, the spec's) for each structural key where the checkpoint's model
    (`saved`, a manifest's `model` section; not a dict in checkpoints that carry none) differs from
    `here` (ModelConfig.architecture()); max_seq_len too with learned positions (a table per position)."""
    if not isinstance(saved, dict):
        return []
    keys = STRUCTURAL + (("max_seq_len",) if here.get("position") == "learned" else ())
    return [(key, saved[key], here.get(key)) for key in keys if key in saved and saved[key] != here.get(key)]


def refuse_another_model(state: dict, here: dict, step: int) -> None:
    """CheckpointMismatch when committed `step` (its manifest's `state`) holds another model than `here`
    (ModelConfig.architecture() of the spec restoring it), before any byte of it is read. Called by a
    restoring rank (orchestrator.rank.state) and a restoring parameter server (paramserver.checkpoint)."""
    differences = model_differences(state.get("model"), here)
    if differences:
        keys = ", ".join(f"{key}={theirs!r} (the spec: {ours!r})" for key, theirs, ours in differences)
        raise CheckpointMismatch(f"checkpoint step {step} is of another model ({keys}): resume with the spec it was "
                                 "trained with, or start the new model under another name (--set name=...)")
