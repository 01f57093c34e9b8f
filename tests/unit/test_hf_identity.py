"""Which initial weights a job started from (ckpt.hf_identity), and `undying run` refusing a spec whose
`model.from_hf` names other weights than its checkpoints started from (orchestrator.cli.resume_check)."""

from __future__ import annotations

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.hf_identity import UNKNOWN, weights_identity, weights_provenance
from ckpt.storage import Storage
from orchestrator.cli.resume_check import resume_problems
from orchestrator.spec.job_spec import validate_spec
from tests._checkpoints import make_state, shard_receipts
from tests._hf import save_hf


def _fine_tuned(base, path):
    """`base` after a (pretend) fine-tune: every value moved a little; same shapes, same config."""
    with torch.no_grad():
        for param in base.parameters():
            param.add_(1e-3)
    base.save_pretrained(path)


def test_the_identity_follows_the_values_not_the_files(tmp_path):
    base = save_hf(tmp_path / "base")
    identity = weights_identity(f"file://{tmp_path}/base")
    assert weights_identity(str(tmp_path / "base")) == identity and len(identity) == 64
    base.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")  # the same values in other files
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert weights_identity(str(tmp_path / "sharded")) == identity
    base.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    base.to(torch.float32).save_pretrained(tmp_path / "bf16-as-fp32")  # (the bf16 values, widened)
    assert weights_identity(str(tmp_path / "bf16-as-fp32")) == weights_identity(str(tmp_path / "bf16")) != identity
    _fine_tuned(base, tmp_path / "tuned")
    assert weights_identity(str(tmp_path / "tuned")) not in (identity, weights_identity(str(tmp_path / "bf16")))


def _spec(tmp_path, from_hf: str | None):
    model = {"from_hf": from_hf} if from_hf else {"preset": "tiny"}
    return validate_spec({"name": "ft", "model": model, "data": {"seq_len": 16, "source": "synthetic"},
                          "train": {"steps": 10, "global_batch": 2, "micro_batch": 1},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 5}})


def _commit(spec, from_hf) -> Catalog:
    catalog = Catalog(Storage(spec.checkpoint_root))
    engine = {"next_step": 5, "global_batch": spec.train.global_batch, "optimizer": spec.train.optimizer,
              "data_seed": spec.data.seed}
    catalog.commit(job=spec.name, step=5, generation=0, layout={"dp": 1}, spec_hash="h",
                   receipts=shard_receipts(catalog, 5, make_state(5)),
                   state={"engine": engine, "model": spec.model.architecture(), "from_hf": from_hf})
    return catalog


def test_a_resume_from_other_initial_weights_is_refused_naming_from_hf(tmp_path):
    base = save_hf(tmp_path / "base")
    _fine_tuned(base, tmp_path / "instruct")  # the same shape and config: only the values differ
    started = _spec(tmp_path, str(tmp_path / "base"))
    catalog = _commit(started, weights_provenance(started.model)["from_hf"])
    assert resume_problems(started, catalog) == []
    other = _spec(tmp_path, str(tmp_path / "instruct"))
    [problem] = resume_problems(other, catalog)
    assert problem.field == "model.from_hf" and "started from other weights than those" in problem.message
    assert "resume without model.from_hf or with the weights they started from" in problem.message
    unknown = _commit(_spec(tmp_path / "u", str(tmp_path / "base")), UNKNOWN)  # unread when it committed
    assert resume_problems(_spec(tmp_path / "u", str(tmp_path / "instruct")), unknown) == []


def test_adding_from_hf_to_a_job_trained_from_scratch_is_refused(tmp_path):
    save_hf(tmp_path / "base")
    scratch = _commit(_spec(tmp_path, None), None)
    # The architecture check would name every key the directory changes; the same shape shows the weights'.
    spec = _spec(tmp_path, str(tmp_path / "base"))
    problems = [p for p in resume_problems(spec, scratch) if p.field == "model.from_hf"]
    assert problems and "were trained from scratch, not from those" in problems[0].message
    assert weights_provenance(_spec(tmp_path, None).model) == {"from_hf": None}


def test_a_resumed_run_records_the_weights_the_job_first_started_from():
    from ckpt.hf_identity import resumed_provenance

    saved = {"from_hf": "a" * 64, "engine": {}}
    # Resumed without from_hf (allowed): the record stays the first run's, so a later run that names
    # those weights again is not told the checkpoints were trained from scratch.
    assert resumed_provenance({"tokenizer": {"url": "t"}, "from_hf": None}, saved) == {"tokenizer": {"url": "t"},
                                                                                     "from_hf": "a" * 64}
    assert resumed_provenance({"from_hf": UNKNOWN}, saved) == {"from_hf": "a" * 64}  # unread now: carried
    assert resumed_provenance({"from_hf": "b" * 64}, {"engine": {}}) == {}  # checkpoints from before the record


def test_the_controller_carries_the_resumed_manifest_s_record_into_its_commits(tmp_path):
    from types import SimpleNamespace

    from orchestrator.controller.checkpoints import Checkpoints
    from orchestrator.controller.restore_policy import RestorePolicy

    spec = _spec(tmp_path, None)  # resumed without from_hf
    catalog = _commit(spec, "a" * 64)
    checkpoints = Checkpoints.__new__(Checkpoints)
    checkpoints.provenance = weights_provenance(spec.model)
    assert checkpoints.provenance == {"from_hf": None}
    checkpoints.restore, checkpoints.spec = RestorePolicy(catalog, 1.0, False), spec
    checkpoints.metrics = SimpleNamespace(on_resumed_commit=lambda at: None)
    checkpoints.gen_begun = None

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    checkpoints.record = SimpleNamespace(history=SimpleNamespace(append=stop))  # the rest of `begin`: not this test's
    with pytest.raises(Stop):
        checkpoints.begin(None, 0, 5)
    assert checkpoints.provenance == {"from_hf": "a" * 64}
