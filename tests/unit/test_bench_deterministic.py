"""The deterministic-kernels benchmark (bench/engine/deterministic.py) on a model small enough
for the default suite: both settings measured, the process-wide switch put back, the losses
compared, its section written."""

from __future__ import annotations

import torch

from bench.engine import deterministic as bench

TINY = "vocab_size=32,n_layers=1,n_heads=2,d_model=16,d_ff=32,max_seq_len=16"


def test_both_settings_are_measured_and_the_switch_is_restored(tmp_path):
    before = torch.are_deterministic_algorithms_enabled()
    docs = tmp_path / "benchmarks.md"
    argv = ["--model", TINY, "--seq-len", "8", "--micro-batch", "2", "--steps", "2", "--warmup", "1",
            "--rounds", "2", "--docs", str(docs)]
    assert bench.main(argv) == 0
    assert torch.are_deterministic_algorithms_enabled() == before
    text = docs.read_text()
    assert bench.SECTION in text and "--rounds 2" in text
    # on the CPU the switch selects no other kernel: the same batches give the same losses
    assert "bitwise equal to on" in text
    assert "(4 timed steps each)" in text


def test_an_off_run_turns_the_switch_off_for_itself_only(monkeypatch):
    job = {"model": bench.parse_model(TINY), "seq_len": 8, "micro_batch": 2, "steps": 1, "warmup": 0}
    seen = []
    original = bench.Engine.train_step

    def spy(engine):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return original(engine)

    monkeypatch.setattr(bench.Engine, "train_step", spy)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        bench.timed_run(job, False)
        assert seen == [False] and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def test_every_round_s_losses_are_compared_not_only_the_first(monkeypatch):
    runs = iter([[1.0, 2.0], [1.0, 2.0], [1.0, 2.5], [1.0, 2.0]])  # round 2's first run (off) differs
    monkeypatch.setattr(bench, "timed_run", lambda job, setting: ([0.1], next(runs)))
    result = bench.measure({"rounds": 2})
    assert result["on_repeats"] and not result["losses_equal"]
    assert "differ from on" in bench.table(result) and "bitwise equal in every round" in bench.table(result)
