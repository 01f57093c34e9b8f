import math

import pytest
import torch

from trainer.config import ModelConfig, TrainConfig
from trainer.model import build_model
from trainer.optim import build_optimizer, clip_grad_norm, lr_at, param_groups


def train(**overrides) -> TrainConfig:
    return TrainConfig(**{"steps": 100, "global_batch": 8, "lr": 1e-3, **overrides})


def test_warmup_is_linear_and_starts_above_zero():
    cfg = train(warmup_steps=10)
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])


def test_cosine_decays_to_min_lr_at_the_last_step():
    cfg = train(warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half-way: midpoint of the cosine
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(150, cfg) == pytest.approx(1e-4)
    decay = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_schedule_edge_cases():
    assert lr_at(0, train()) == pytest.approx(1e-3)  # no warm-up: full lr at once
    short = train(steps=5, warmup_steps=5, min_lr_ratio=0.5)
    assert lr_at(4, short) == pytest.approx(1e-3)
    assert lr_at(5, short) == pytest.approx(5e-4)


def test_weight_decay_only_on_matrices():
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    decayed, plain = param_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"])
    assert all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_adamw_decay_is_decoupled():
    # With zero gradients Adam's update is 0, so only the decoupled decay moves the weights.
    model = build_model(ModelConfig(preset="tiny", n_layers=1), seed=0)
    optimizer = build_optimizer(model, train(weight_decay=0.5))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 1e-3 * 0.5 if p.ndim == 2 else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-9)


def test_sgd_uses_momentum_from_betas():
    model = build_model(ModelConfig(preset="tiny", n_layers=1), seed=0)
    optimizer = build_optimizer(model, train(optimizer="sgd", betas=(0.8, 0.99)))
    assert isinstance(optimizer, torch.optim.SGD)
    assert {g["momentum"] for g in optimizer.param_groups} == {0.8}


def test_clip_grad_norm_reports_the_norm_before_clipping():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert clip_grad_norm(params, max_norm=1.0) == pytest.approx(5.0)
    total = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    assert total == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norm_leaves_small_or_unclipped_gradients_alone():
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([0.3, 0.4])
    assert clip_grad_norm([param], max_norm=1.0) == pytest.approx(0.5)
    assert torch.equal(param.grad, torch.tensor([0.3, 0.4]))
    param.grad = torch.tensor([30.0, 40.0])
    assert clip_grad_norm([param], max_norm=None) == pytest.approx(50.0)
    assert torch.equal(param.grad, torch.tensor([30.0, 40.0]))
    assert clip_grad_norm([torch.nn.Parameter(torch.zeros(1)), param], max_norm=None) == pytest.approx(50.0)
