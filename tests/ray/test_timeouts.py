"""Timeouts that scale, on a real local Ray cluster: a first step that takes a minute on every rank
(compilation, warm-up on a large model) is no hang, and a rank stopped with SIGSTOP later still is,
within the steady limit max(10 s, 5 x the median step) (orchestrator.controller.timeouts)."""

from __future__ import annotations

import json
import re

import pytest

from tests.ray.jobs import run_job

pytestmark = [pytest.mark.ray, pytest.mark.heavy]

FIRST_STEP_DELAY_S = 60


def test_a_one_minute_first_step_on_every_rank_is_no_hang_but_a_stopped_rank_is(ray_cluster, tmp_path, reference):
    slow = [f"{{kind: slow_rank, rank: {r}, at_step: 0, delay_s: {FIRST_STEP_DELAY_S}}}" for r in range(4)]
    hang = "{kind: hang_rank, rank: 2, at_step: 25}"
    proc, path = run_job(ray_cluster, tmp_path, "slowstart", [f"chaos.faults=[{', '.join(slow)}, {hang}]"],
                         timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(path.read_text())
    # Nothing measured yet: the first step may take 120 s on CPU, the process group 2 x that.
    assert "timeouts: hang max(10 s, 5 x median step), first step 120 s, process group 240 s" in proc.stdout
    first = report["losses"][0]
    assert first["step"] == 0 and first["time"] >= FIRST_STEP_DELAY_S  # the slow first step ran, unharmed
    [failure] = report["failures"]  # the SIGSTOP only: the slow first step was not declared a hang
    assert failure["kind"] == "hang_rank" and failure["rank"] == 2
    assert 9.0 < failure["detected_after_s"] < 30.0  # the steady limit (10 s) plus polling and release
    assert "killed [2]" in proc.stdout
    # The next generation's first step gets 3 x the first step measured (a minute and a bit).
    firsts = [int(m) for m in re.findall(r"timeouts: .*?, first step (\d+) s", proc.stdout)]
    assert firsts[0] == 120 and 3 * FIRST_STEP_DELAY_S <= firsts[-1] < 300, firsts
    assert report["final_loss"] == reference["final_loss"]
