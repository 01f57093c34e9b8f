"""A spare's warm-up: a first engine build and step on a tiny twin of the job's model."""

import time

import pytest
import torch
import yaml

from orchestrator.rank.warmup import tiny_twin, warm_first_step
from orchestrator.spec.job_spec import JobSpec
from trainer.config import ModelConfig
from trainer.engine import Engine


def _spec(**model):
    with open("examples/demo.yaml") as f:
        raw = yaml.safe_load(f)
    if model:
        raw["model"] = model
    return JobSpec.model_validate(raw)


@pytest.mark.parametrize("model", [{}, {"preset": "llama3.1-70b"}, {"preset": "tiny-llama", "tie_embeddings": False}])
def test_the_twin_keeps_the_architecture_and_shrinks_every_dimension(model):
    spec = _spec(**model)
    twin, data, train, parallel = tiny_twin(spec.model, spec.train)
    for key in ("activation", "position", "norm", "tie_embeddings", "rope_theta", "norm_eps"):
        assert getattr(twin, key) == getattr(spec.model, key), key
    assert (twin.n_kv_heads < twin.n_heads) == (spec.model.n_kv_heads < spec.model.n_heads)
    assert (train.precision, train.optimizer, train.deterministic) == (
        spec.train.precision, spec.train.optimizer, spec.train.deterministic)
    ModelConfig.model_validate(twin.model_dump())  # a valid model in its own right
    assert sum(p.numel() for p in Engine(twin, data, train, parallel, rank=0, world_size=1).model.parameters()) < 50_000
    assert (parallel.dp, parallel.tp, parallel.pp, data.source) == (1, 1, 1, "synthetic")


def test_warming_a_70b_job_takes_a_moment_and_leaves_training_unchanged():
    spec = _spec()

    def losses():
        engine = Engine(spec.model, spec.data, spec.train, spec.parallel.with_dp(1), rank=0, world_size=1)
        try:
            return [engine.train_step().loss for _ in range(2)]
        finally:
            engine.data.close(wait=False)

    before = losses()
    started = time.perf_counter()
    warm_first_step(_spec(preset="llama3.1-70b"), torch.device("cpu"))
    assert time.perf_counter() - started < 10  # a full 70B build would not end, nor fit
    assert losses() == before  # the twin leaves no state (seeds, RNG) the job's engine sees


def test_a_twin_that_fails_leaves_the_spare_a_spare(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr("trainer.engine.Engine", broken)
    assert warm_first_step(_spec(), torch.device("cpu")) is None
    assert "spare warm-up: the tiny twin of the model failed (RuntimeError: no such kernel)" in caplog.text


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_twins_graphs_are_forgotten_before_the_real_model_compiles(monkeypatch, compiled):
    # Left in dynamo's caches, the twin's graphs (its shapes) would make the real block's compile mark
    # the dimensions that differ dynamic: other kernels than the ranks that never warmed up run.
    import torch._dynamo

    import trainer.engine

    resets: list[bool] = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    monkeypatch.setattr(trainer.engine.Engine, "train_step", lambda self: None)  # the build alone: no compile here
    spec = _spec()
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"compile": compiled})})
    assert warm_first_step(spec, torch.device("cpu")) is not None
    assert resets == ([True] if compiled else [])
