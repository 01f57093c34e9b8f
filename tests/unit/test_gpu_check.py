"""The GPU check without a GPU: peaks and MFU arithmetic, FLOPs per token, tolerances and
verdicts from injected measurements, the table, exit codes, and exit 3 here (no CUDA)."""

import pytest
import torch

from bench.gpu_check import judge
from bench.gpu_check.main import main, no_cuda_message
from bench.gpu_check.peaks import bf16_peak, mfu
from bench.gpu_check.verdict import (
    FAIL,
    INFO,
    NOT_TESTED,
    OK,
    UNKNOWN,
    Row,
    exit_code,
    format_markdown,
    format_table,
    within_relative,
)
from trainer.config import ModelConfig
from trainer.costmodel.layout import Layout, Workload, stage_params
from trainer.costmodel.time import rank_flops_per_token
from trainer.model import flops_per_token

LLAMA_1B = ModelConfig(preset="llama3.2-1b")


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H200", 989.5e12), ("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA GH200 480GB", 989.5e12),
    ("NVIDIA L40S", 362.05e12), ("NVIDIA B200", 2250e12), ("NVIDIA GeForce RTX 4090", None), ("", None)])
def test_bf16_peak_by_device_name(name, peak):
    assert bf16_peak(name) == peak


def test_a_torch_older_than_the_package_needs_is_named_and_the_checks_still_run():
    from bench.gpu_check.main import torch_too_old

    assert torch_too_old("2.13.0+cu130") is None and torch_too_old("2.14.1") is None
    assert "older than the torch>=2.13" in torch_too_old("2.5.1+cu124")
    assert torch_too_old("2.13.0a0+git1234") is None  # a source build of that release


def test_a_run_cut_short_leaves_the_figures_taken_and_a_set_up_that_raises_is_a_failed_row(tmp_path, monkeypatch):
    import json

    from bench.gpu_check import main as gpu_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as far as main looks
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 141e9})())

    class CutShort(gpu_main.Checks):
        def __init__(self, args, result, save):
            self.args, self.result, self.rows, self.save = args, result, [], save

        def run(self):
            self._attempt("first", lambda: [Row("first", "1", "", "ok")])
            self._attempt("second", lambda: 1 / 0)
            raise KeyboardInterrupt  # the time limit: what was saved must be on disk already

    monkeypatch.setattr(gpu_main, "Checks", CutShort)
    out = tmp_path / "gpu_check.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_main.main(["--out", str(out)])
    saved = json.loads(out.read_text())
    assert [(r["check"], r["status"]) for r in saved["rows"]] == [("torch version", "info"), ("first", "ok"),
                                                                   ("second", "FAIL")] and saved["exit_code"] == 1
    assert saved["args"]["micro_batch"] == 8 and saved["complete"] is False  # 141 GB: the default micro-batch
    assert set(saved["elapsed_s"]) == {"first", "second"}  # each check's seconds: the time budget's record

    monkeypatch.setattr(gpu_main, "Checks", lambda *a: 1 / 0)  # the set-up itself raises
    table = tmp_path / "gpu_check.md"
    assert gpu_main.main(["--out", str(out), "--markdown", str(table)]) == 1
    saved = json.loads(out.read_text())
    assert [r["check"] for r in saved["rows"]] == ["torch version", "set-up"] and saved["complete"] is True
    assert table.read_text().splitlines()[2].startswith("| torch version | 2.5.1+cu124 |")


def test_a_ranks_peak_at_its_precision_comes_from_the_same_table():
    from trainer.costmodel.hardware import named_peak

    assert named_peak("NVIDIA H100 80GB HBM3", "fp32") == 67e12 and named_peak("NVIDIA H100 PCIe", "fp16") == 756e12
    assert named_peak("NVIDIA H100 PCIe", "fp32") is None  # not guessed from the SXM part's
    assert named_peak("NVIDIA GeForce RTX 4090", "bf16") is None


def test_mfu_is_model_flops_over_peak_and_unknown_without_a_peak():
    assert mfu(50_000, 8e9, 1000e12) == pytest.approx(0.4)
    assert mfu(50_000, 8e9, None) is None
    with pytest.raises(ValueError, match="positive"):
        mfu(1, 1, 0.0)


def test_flops_per_token_of_the_1b_preset_by_hand_and_as_the_cost_model_counts_them():
    # 1,235,814,400 parameters (published) less the norm gains (16 blocks x 2 x 2048 + 2048) multiply
    # activations: 6 FLOPs each, plus 12 L h s of attention at s = 2048.
    matmul_params = 1_235_814_400 - 16 * 2 * 2048 - 2048
    assert flops_per_token(LLAMA_1B, 2048) == 6 * matmul_params + 12 * 16 * 2048 * 2048 == 8_219_787_264
    work = Workload(model=LLAMA_1B, seq_len=2048, global_batch=8, precision="bf16")
    layout = Layout(micro_batch=8)
    assert rank_flops_per_token(work, layout, stage_params(LLAMA_1B, layout, 0, 2048)) == flops_per_token(LLAMA_1B,
                                                                                                          2048)


def test_table_is_aligned_and_ends_with_the_verdict():
    rows = [Row("device", "1 x NVIDIA H200", "torch 2.13"), Row("memory", "1.00x", "within 15%", FAIL),
            Row("  reduce_scatter", "ran", "needs >= 2 GPUs", NOT_TESTED)]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["check", "measured", "target", "status"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    starts = {line.index(word) for line, word in zip(lines[2:5], ["torch", "within", "needs"], strict=True)}
    assert len(starts) == 1  # the target column starts at one place on every row
    assert lines[-1] == "gpu-check FAILED: 1 FAIL, 1 info, 1 not tested"
    assert format_table([Row("a", "b", "c", OK)]).splitlines()[-1] == "gpu-check passed: 1 ok"


def test_exit_code_only_counts_failures():
    assert exit_code([Row("a", "b", "", s) for s in (OK, INFO, NOT_TESTED, UNKNOWN)]) == 0
    assert exit_code([Row("a", "b", "", OK), Row("c", "d", "", FAIL)]) == 1
    with pytest.raises(ValueError, match="status"):
        Row("a", "b", "", "passed")


def test_within_relative():
    assert within_relative(115, 100, 0.15) and within_relative(85, 100, 0.15)
    assert not within_relative(116, 100, 0.15) and not within_relative(84, 100, 0.15)
    assert not within_relative(1, 0, 0.15)


def run(**overrides) -> dict:
    base = {"preset": "llama3.2-1b", "recompute": "none", "compile": False, "compile_via": None, "step_s": 0.4,
            "tokens_per_s": 16384 / 0.4, "flops_per_token": 8_219_787_264, "losses": [11.9, 11.5],
            "max_memory_allocated": 70 * 2**30, "max_memory_reserved": 72 * 2**30,
            "predicted": {"total": 74 * 2**30}, "deterministic": True, "deterministic_algorithms": True,
            "fused_adamw": True}
    return {**base, **overrides}


def test_mfu_below_the_target_fails_only_where_judged():
    slow = run(tokens_per_s=40_000)  # 40k x 8.22 GFLOP = 329 TFLOP/s = 33 % of an H200
    row = judge.throughput_row(slow, 989.5e12, "NVIDIA H200", 0.40, judge_mfu=True)
    assert row.status == FAIL and "MFU 33.2% of 990 TFLOP/s" in row.measured
    assert judge.throughput_row(slow, 989.5e12, "NVIDIA H200", 0.40, judge_mfu=False).status == INFO
    fast = run(tokens_per_s=50_000)  # 41.5 %
    assert judge.throughput_row(fast, 989.5e12, "NVIDIA H200", 0.40, judge_mfu=True).status == OK


def test_mfu_of_an_unknown_gpu_says_unknown_peak():
    row = judge.throughput_row(run(), None, "NVIDIA RTX 9000", 0.40, judge_mfu=True)
    assert row.status == UNKNOWN and "MFU unknown peak" in row.measured and "RTX 9000" in row.measured


def test_memory_mismatch_beyond_15_percent_fails_the_check():
    # Judged against the reserved peak (72 GiB): the prediction holds the allocator's fragmentation.
    assert judge.memory_row(run(), 0.15).status == OK  # 74 / 72 = 1.03
    assert "allocated 70.00 GiB" in judge.memory_row(run(), 0.15).measured
    over = judge.memory_row(run(predicted={"total": 90 * 2**30}), 0.15)
    assert over.status == FAIL and "1.25x" in over.measured
    under = judge.memory_row(run(predicted={"total": 50 * 2**30}), 0.15)
    assert under.status == FAIL and exit_code([under]) == 1
    # What an earlier run left reserved is not this run's: 72 - 10 GiB measured against 74 is 1.19x.
    leftovers = judge.memory_row(run(reserved_before=10 * 2**30), 0.15)
    assert leftovers.status == FAIL and "1.19x" in leftovers.measured and "10.00 GiB held before" in leftovers.measured


def test_the_markdown_table_pastes_into_the_benchmarks_page():
    rows = [Row("llama3.2-1b rc=none bf16", "300 ms/step | 54.6k tok/s", "MFU >= 40%", OK), Row("device", "H200")]
    assert format_markdown(rows).splitlines() == [
        "| check | measured | target | status |", "| --- | --- | --- | --- |",
        "| llama3.2-1b rc=none bf16 | 300 ms/step \\| 54.6k tok/s | MFU >= 40% | ok |", "| device | H200 |  | info |"]


def test_compile_row_compares_first_losses_and_reports_the_speedup():
    compiled = run(compile=True, compile_via="train.compile", step_s=0.32, losses=[11.95, 11.4])
    row = judge.compile_row(run(), compiled)
    assert row.status == OK and "1.25x eager speed" in row.measured
    assert judge.compile_row(run(), run(compile=True, compile_via="x", losses=[12.5, 11.0])).status == FAIL
    assert judge.compile_row(run(), run(compile=True, compile_via="x", losses=[float("nan"), 1.0])).status == FAIL


def resume(**overrides) -> dict:
    base = {"preset": "small", "steps": 3, "deterministic": True, "deterministic_algorithms": True,
            "straight": [10.8, 10.1, 9.7], "rerun": [10.8, 10.1], "resumed": 9.7, "fused_adamw": True,
            "restored_step_devices": ["cuda:0"]}
    return {**base, **overrides}


def test_determinism_rows_demand_bitwise_losses_when_the_default_is_deterministic():
    assert [r.status for r in judge.determinism_rows(resume())] == [OK, OK, OK, OK]
    nudged = judge.determinism_rows(resume(rerun=[10.8, 10.1 + 1e-6], resumed=9.7 + 1e-6))
    assert [r.status for r in nudged] == [OK, FAIL, FAIL, OK]
    relaxed = judge.determinism_rows(resume(deterministic=False, deterministic_algorithms=False,
                                            rerun=[10.8, 10.1 + 1e-6], resumed=9.7 + 1e-6))
    assert [r.status for r in relaxed] == [OK, OK, OK, OK]
    assert judge.determinism_rows(resume(deterministic_algorithms=False))[0].status == FAIL


def test_fused_adamw_row_needs_the_restored_step_on_the_gpu():
    assert judge.determinism_rows(resume(restored_step_devices=["cpu"]))[-1].status == FAIL
    assert judge.determinism_rows(resume(fused_adamw=False))[-1].status == FAIL
    assert judge.determinism_rows(resume(restored_step_devices=[]))[-1].status == FAIL


def test_staging_rows_judge_exact_pinned_and_rate_against_the_anchor():
    raw = {"mib": 1024, "gbps": 50.0}
    good = {"mib": 1024, "warm_s": 0.03, "gbps": 35.8, "exact": True, "pinned": True, "ok": True}
    slow = {**good, "gbps": 6.0}
    rows = judge.staging_rows(raw, good, slow, min_gbps=10)
    assert [r.status for r in rows] == [INFO, OK, FAIL]
    assert "72% of pinned copy" in rows[1].measured
    unpinned = {**good, "pinned": False, "ok": False}
    assert judge.staging_rows(raw, unpinned, good, 10)[1].status == FAIL


def test_a_check_that_raised_is_a_failure_with_its_last_line():
    row = judge.failed_row("nccl", "Traceback...\n  File x\nRuntimeError: NCCL error: unhandled system error\n")
    assert row.status == FAIL and row.measured == "raised: RuntimeError: NCCL error: unhandled system error"


def test_without_cuda_it_exits_3_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine; on a GPU one too
    assert main([]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpu-check: no CUDA device") and "nothing was checked" in err[0]
    assert "CPU-only build" in no_cuda_message(torch) or torch.version.cuda is not None


def test_deterministic_cost_is_reported_as_on_against_off():
    row = judge.deterministic_cost_row(run(step_s=0.44), run(step_s=0.40, deterministic=False))
    assert row.status == INFO
    assert "on 440 ms/step, off 400 ms/step: deterministic costs +10.0% (default on)" in row.measured
    flipped = judge.deterministic_cost_row(run(step_s=0.40, deterministic=False), run(step_s=0.44))
    assert "costs +10.0% (default off)" in flipped.measured
