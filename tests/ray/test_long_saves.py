"""A save longer than the hang limit is no hang, end to end on the local Ray cluster.

The ranks block on a save at the final step (until their shards are written) and at a stop
step; meanwhile no step is reported. Here one rank's shard writes are delayed well past the
hang limit (chaos storage_latency on its writer's Storage, 4 s limit): the job must neither
declare a hang nor kill the writing ranks, and the save must commit (the rank beats while it
waits, with the bytes its writer has written: orchestrator.rank.beats, controller/save_watch).
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.ray.jobs import run_job, start_job, wait_for

pytestmark = pytest.mark.ray

HANG_S = 4
DELAY_S = 10


def _latency(rank: int, **where) -> str:
    fields = ", ".join(f"{k}: {v}" for k, v in where.items())
    return f"{{kind: storage_latency, op: write, path: '*/shard-*', rank: {rank}, delay_s: {DELAY_S}, {fields}}}"


# Heavy (about 30 s on two cores): the stop's save below outlasts the hang limit the same way (ranks
# blocked on their writers, beating with the bytes written), and tests/unit/test_save_watch.py covers the watch.
@pytest.mark.heavy
def test_a_final_save_longer_than_the_hang_limit_commits_without_a_hang(ray_cluster, tmp_path):
    proc, path = run_job(ray_cluster, tmp_path, "longfinal",
                         [f"elastic.hang_timeout_s={HANG_S}", "train.steps=20",
                          f"chaos.faults=[{_latency(1, at_step=20)}]"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(path.read_text())
    assert report["failures"] == [] and "no step for" not in proc.stdout
    assert report["final_step"] == 20 and report["checkpoints"][-1]["step"] == 20
    assert report["checkpoints"][-1]["total_s"] >= DELAY_S  # the final write did take the delay


def test_a_stop_whose_save_outlasts_the_hang_limit_commits_and_exits_75(ray_cluster, tmp_path):
    # Every shard write of rank 2 takes 10 s: the stop step's save too, before any commit of this run
    # (so no measured save time widens the limit), and the periodic saves block training behind them.
    proc, report, log = start_job(ray_cluster, tmp_path, "longstop",
                                  [f"elastic.hang_timeout_s={HANG_S}", f"chaos.faults=[{_latency(2, repeat='true')}]"])
    wait_for(log, "-> RUNNING", proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=90)
    text = log.read_text()
    assert code == 75, text[-4000:]
    committed = int(re.search(r"checkpoint step (\d+) committed, every rank stopped", text).group(1))
    result = json.loads(report.read_text())
    assert result["status"] == "preempted" and result["final_step"] == committed and result["failures"] == []
    assert "no step for" not in text
