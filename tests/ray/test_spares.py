"""The spare pool on a real local Ray cluster: a warm spare takes over a killed rank, a new spare
starts in the freed seat and warms up in the background, and the next kill is taken by it."""

from __future__ import annotations

import json
import re

import pytest

from tests.ray.jobs import run_job

pytestmark = pytest.mark.ray


@pytest.mark.heavy
def test_a_consumed_spare_is_replaced_and_the_new_spare_takes_the_second_kill(ray_cluster, tmp_path, reference):
    # 4 ranks and 1 spare hold 5 of the cluster's 6 slots. Rank 0 sleeps 9x its compute per step (sleeps
    # only: the numbers are unchanged) so that the 20 steps between the kills outlast a new actor's warm-up.
    faults = ("[{kind: kill_rank, rank: 1, at_step: 12}, {kind: kill_rank, rank: 2, at_step: 32}, "
              "{kind: slow_rank, rank: 0, at_step: 0, factor: 10}]")
    proc, path = run_job(ray_cluster, tmp_path, "refill", ["elastic.spares=1", f"chaos.faults={faults}"])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    out, report = proc.stdout, json.loads(path.read_text())
    print("\n".join(line for line in out.splitlines() if "spare pool" in line or "taken over" in line))

    def at(pattern: str) -> int:
        match = re.search(pattern, out)
        assert match, f"no {pattern!r} in:\n{out[-5000:]}"
        return match.start()

    # Rank 1's spare came from the placement; once training ran again, the refill put a new one in
    # rank 1's old seat, which warmed up before rank 2 was killed and took it over; the pool was
    # refilled again after that.
    first = at(r"kill_rank on rank 1; rank\(s\) \[1\] taken over by warm spares")
    refill = at(r"spare pool: rank\(s\) \[1\] replaced, training again; 1 new spare\(s\) warming up in the "
                r"background in seat\(s\) \[1\]")
    warm = at(r"spare pool: the new spare in seat 1 is warm, [0-9.]+ s after it was started")
    second = at(r"kill_rank on rank 2; rank\(s\) \[2\] taken over by warm spares")
    assert first < refill < warm < second
    at(r"spare pool: rank\(s\) \[2\] replaced, training again; 1 new spare\(s\) warming up in the background "
       r"in seat\(s\) \[2\]")
    assert "replaced by new actors" not in out and "shrinking" not in out
    assert [(f["kind"], f["rank"]) for f in report["failures"]] == [("kill_rank", 1), ("kill_rank", 2)]
    for failure in report["failures"]:  # a warm spare: re-formed and training again within seconds
        assert failure["first_step_after_s"] is not None and failure["first_step_after_s"] < 10.0, failure
    # The same layout throughout: the model is the failure-free run's, bit for bit.
    assert report["final_loss"] == reference["final_loss"]
    assert [(s["step"], s["loss"]) for s in report["losses"]] == [(s["step"], s["loss"]) for s in reference["losses"]]


@pytest.mark.heavy
def test_a_kill_while_the_new_spare_warms_up_waits_for_it(ray_cluster, tmp_path, reference):
    # The second kill comes two steps after the first recovery, while the refilled spare is still
    # warming up: the recovery waits for it instead of starting a new actor beside it.
    faults = "[{kind: kill_rank, rank: 1, at_step: 12}, {kind: kill_rank, rank: 2, at_step: 14}]"
    proc, path = run_job(ray_cluster, tmp_path, "warming", ["elastic.spares=1", f"chaos.faults={faults}"])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    out, report = proc.stdout, json.loads(path.read_text())
    print("\n".join(line for line in out.splitlines() if "spare pool" in line or "taken over" in line))
    assert re.search(r"kill_rank on rank 1; rank\(s\) \[1\] taken over by warm spares", out), out[-5000:]
    assert re.search(r"kill_rank on rank 2; rank\(s\) \[2\] taken over by a spare that finished warming up "
                     r"[0-9.]+ s into the recovery", out), out[-5000:]
    assert "replaced by new actors" not in out and "shrinking" not in out
    assert [(f["kind"], f["rank"]) for f in report["failures"]] == [("kill_rank", 1), ("kill_rank", 2)]
    assert report["final_loss"] == reference["final_loss"]
    assert [(s["step"], s["loss"]) for s in report["losses"]] == [(s["step"], s["loss"]) for s in reference["losses"]]
