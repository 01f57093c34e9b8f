"""The GPU check's training runs on the CPU with the tiny preset (the same code as on cuda:0),
and the optimizer choice they report: fused AdamW only where every parameter is on CUDA, and
a restored `step` where the fused kernel reads it."""

from types import SimpleNamespace

import torch

from bench.gpu_check import judge, training
from bench.gpu_check.verdict import FAIL, OK
from trainer.config import ModelConfig, TrainConfig
from trainer.dtensor_slices import fresh_field
from trainer.model import build_model, flops_per_token
from trainer.optim import build_optimizer, fused_on, keeps_step_on_device


def test_train_run_reports_throughput_flops_and_the_prediction():
    got = training.train_run("tiny", seq_len=32, micro_batch=2, steps=2, warmup=1, device="cpu")
    assert len(got["losses"]) == 3 and got["tokens_per_s"] > 0 and got["step_s"] > 0
    assert got["flops_per_token"] == flops_per_token(ModelConfig(preset="tiny"), 32)
    assert got["deterministic"] is TrainConfig.model_fields["deterministic"].default
    assert got["deterministic_algorithms"] == got["deterministic"]
    assert got["fused_adamw"] is False  # CPU parameters
    assert got["predicted"]["total"] == sum(got["predicted"][k] for k in ("state", "activation", "collective",
                                                                           "transient"))


def test_resume_run_is_bitwise_on_the_cpu_and_judged_so():
    got = training.resume_run("tiny", seq_len=32, micro_batch=2, steps=3, device="cpu")
    assert got["rerun"] == got["straight"][:2] and got["resumed"] == got["straight"][2]
    assert got["restored_step_devices"] == ["cpu"]
    statuses = [row.status for row in judge.determinism_rows(got)]
    assert statuses == [OK, OK, OK, FAIL]  # fused AdamW needs CUDA: the last row fails here


def test_fused_only_where_every_parameter_is_on_cuda():
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    assert fused_on([cuda, cuda]) and not fused_on([cuda, cpu]) and not fused_on([])
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    optimizer = build_optimizer(model, TrainConfig(steps=1, global_batch=1))
    assert not optimizer.defaults["fused"] and not keeps_step_on_device(optimizer)


def test_a_restored_step_follows_a_fused_optimizer_onto_the_device():
    param = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    assert fresh_field(param, "step").device.type == "cpu"
    on_device = fresh_field(param, "step", step_on_device=True)
    assert on_device.device.type == "meta" and on_device.dtype == torch.float32 and on_device.shape == ()
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)  # CPU fused kernel exists
    assert keeps_step_on_device(fused)


def test_a_flipped_deterministic_run_sets_torch_for_the_run_only():
    before = torch.are_deterministic_algorithms_enabled()
    flip = not TrainConfig.model_fields["deterministic"].default
    got = training.train_run("tiny", seq_len=32, micro_batch=2, steps=1, warmup=0, device="cpu", deterministic=flip)
    assert got["deterministic"] is flip and got["deterministic_algorithms"] is flip
    assert torch.are_deterministic_algorithms_enabled() is before


def test_the_compiled_run_compiles_through_train_compile():
    # The check measures the engine's own compile path (trainer.compile), the one jobs take.
    assert training.configs("tiny", 32, 2, 3, compile=True)[2].compile is True
    assert training.configs("tiny", 32, 2, 3)[2].compile is False
