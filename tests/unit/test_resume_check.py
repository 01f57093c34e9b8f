"""`undying run` on a root with committed checkpoints refuses a spec that would not resume them
(another model, another trajectory, other data) before any rank exists, naming the field and the fix; knobs a
resume may turn pass."""

from __future__ import annotations

from ckpt.catalog import Catalog
from ckpt.storage import Storage
from orchestrator.cli.resume_check import refused_resume, resume_problems
from orchestrator.spec.job_spec import validate_spec
from tests._checkpoints import make_state, shard_receipts
from trainer.data import data_identity


def _spec(tmp_path, model=None, data=None, **train):
    return validate_spec({"name": "resume", "model": model or {"preset": "tiny"}, "data": data or {"seq_len": 16},
                          "train": {"steps": 10, "global_batch": 4, "micro_batch": 1, **train},
                          "parallel": {"dp": 2}, "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 5}})


def _commit(spec, step: int) -> Catalog:
    catalog = Catalog(Storage(spec.checkpoint_root))
    engine = {"next_step": step, "global_batch": spec.train.global_batch, "optimizer": spec.train.optimizer,
              "data_seed": spec.data.seed, "train_seed": spec.train.seed,
              "data": data_identity(spec.data, spec.model.vocab_size)}
    catalog.commit(job=spec.name, step=step, generation=0, layout={"dp": 2}, spec_hash="h",
                   receipts=shard_receipts(catalog, step, make_state(step)),
                   state={"engine": engine, "model": spec.model.architecture()})
    return catalog


def test_another_model_or_trajectory_is_refused_by_field_and_a_resume_knob_is_not(tmp_path, capsys):
    trained = _spec(tmp_path)
    assert resume_problems(trained, Catalog(Storage(trained.checkpoint_root))) == []  # nothing committed
    catalog = _commit(trained, 5)
    assert resume_problems(trained, catalog) == [] and not refused_resume(trained)

    fewer = _spec(tmp_path, {"preset": "tiny", "n_layers": 2, "tie_embeddings": False})
    problems = resume_problems(fewer, catalog)
    assert [p.field for p in problems] == ["model.n_layers", "model.tie_embeddings"]
    assert "are of a model with n_layers=4, this spec gives 2" in problems[0].message
    assert "start the new model under another name (--set name=...)" in problems[0].message
    assert refused_resume(fewer)
    err = capsys.readouterr().err
    assert "model.n_layers" in err and "model.tie_embeddings" in err

    batch = _spec(tmp_path, global_batch=8)
    assert [p.field for p in resume_problems(batch, catalog)] == ["train.global_batch"]
    knobs = _spec(tmp_path, {"preset": "tiny", "rope_theta": 500000.0, "dropout": 0.1}, lr=1e-4, steps=20)
    assert resume_problems(knobs, catalog) == []
    # After a restore train.seed draws only dropout masks: another seed is refused only with dropout.
    assert resume_problems(_spec(tmp_path, seed=7), catalog) == []
    reseeded = _spec(tmp_path, {"preset": "tiny", "dropout": 0.1}, seed=7)
    assert [p.field for p in resume_problems(reseeded, catalog)] == ["train.seed"]


def test_an_unreadable_newest_manifest_is_left_to_the_restore(tmp_path):
    spec = _spec(tmp_path)
    catalog = _commit(spec, 5)
    catalog.storage.fs.pipe_file(catalog.manifest_path(5), b"{torn")
    catalog.storage.invalidate()
    assert resume_problems(_spec(tmp_path, {"preset": "tiny", "n_layers": 2}), catalog) == []


def test_other_data_is_refused_before_any_rank_starts(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    trained = _spec(tmp_path, data={"source": "text", "path": str(text), "seq_len": 16})
    catalog = _commit(trained, 5)
    assert resume_problems(trained, catalog) == []  # the same data: it resumes
    longer = _spec(tmp_path, data={"source": "text", "path": str(text), "seq_len": 32})
    [problem] = resume_problems(longer, catalog)
    assert problem.field == "data" and "their seq_len differ" in problem.message
    text.write_text("another corpus altogether, " * 40)  # the same path, other bytes
    [problem] = resume_problems(trained, catalog)
    assert problem.field == "data" and "bytes, crc32 differ" in problem.message
    assert "resuming would repeat some samples and skip others" in problem.message
