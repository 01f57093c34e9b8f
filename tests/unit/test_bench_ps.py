"""bench.ps without processes: the traffic formulas against the servers' own counters (the protocol
run in one process), the loss-against-wall-time curves, the time to a target loss, the tables."""

from __future__ import annotations

import pytest
import torch

from bench.ps import analysis, runs
from bench.ps.analysis import Event, Run
from bench.ps.main import byte_rows, parse
from paramserver.actors import StepLog
from paramserver.lockstep import build_in_process, run_lockstep
from trainer.config import ParallelConfig

JOB = {"model": {"preset": "tiny", "n_layers": 1, "d_model": 32, "d_ff": 64, "n_heads": 2, "vocab_size": 512,
                 "max_seq_len": 32, "tie_embeddings": False},
       "seq_len": 16, "global_batch": 4, "micro_batch": 1, "steps": 3, "lr": 3e-3, "workers": 2, "servers": 2,
       "staleness": 1}


def test_formulas():
    assert analysis.ps_total(4, 100) == 800
    assert analysis.ps_per_server(4, 100, 2) == 400
    assert analysis.ring_per_rank(4, 100) == 150  # 2 (D-1)/D S
    assert analysis.ring_per_rank(1, 100) == 0
    assert analysis.sparse_state_bytes(1000, rows=10, row_bytes=128) == 1000 + 10 * 136


def _counters(consistency: str) -> dict:
    model, data, train = runs.configs(JOB)
    parallel = ParallelConfig(dp=JOB["workers"], mode="ps", servers=JOB["servers"], consistency=consistency,
                              staleness=1 if consistency == "ssp" else None)
    setup = build_in_process(model, data, train, parallel)
    run_lockstep(setup, JOB["steps"])
    per_server = [(s.bytes_in + s.bytes_out) / JOB["steps"] for s in setup.servers]
    return {"total": sum(per_server), "per_server": per_server,
            "shard_bytes": [sum(p.nbytes for p in s.slices) for s in setup.servers]}


def test_the_formulas_match_the_servers_counters_dense_and_sparse():
    torch.set_num_threads(1)
    sizes = runs.state_bytes(JOB)
    rows = runs.touched_rows(JOB)
    assert len(rows) == JOB["steps"] * JOB["workers"] and 0 < max(rows) < JOB["model"]["vocab_size"]
    table = byte_rows(JOB, {"bsp": _counters("bsp"), "ssp": _counters("ssp")}, sizes, rows)
    by_what = {r["what"].split(" (")[0].split(",")[0]: r for r in table if "server " not in r["what"]}
    # Dense bsp moves exactly 2DS; the sparse path exactly the touched rows with their ids.
    assert by_what["ps bsp"]["measured"] == pytest.approx(by_what["ps bsp"]["formula"], rel=1e-12)
    assert by_what["ps ssp"]["measured"] == pytest.approx(by_what["ps ssp"]["formula"], rel=1e-12)
    assert by_what["ps ssp"]["measured"] < by_what["ps bsp"]["measured"]
    servers = [r for r in table if r["what"].startswith("ps bsp, server")]
    assert len(servers) == 2 and sum(r["measured"] for r in servers) == pytest.approx(by_what["ps bsp"]["measured"])
    assert by_what["ring all-reduce"]["measured"] is None
    text = analysis.bytes_table(table)
    assert "| ring all-reduce, per rank | computed only | 2(D-1)/D S = " in text and "| 1.000 |" in text


def _log(worker: int, step: int, finished: float, loss: float, tokens: int = 10) -> StepLog:
    return StepLog(worker, step, loss * tokens, tokens, pull_wait_s=0.1, compute_s=0.2, push_s=0.1,
                   finished_at=finished)


def test_ps_events_start_when_every_worker_finished_its_first_step_and_come_in_finishing_order():
    logs = [_log(1, 0, 1000.5, 4.0), _log(0, 0, 1000.4, 5.0), _log(0, 1, 1001.0, 3.0)]
    events = analysis.ps_events(logs)
    assert [round(e.t, 6) for e in events] == [-0.1, 0.0, 0.5]
    assert [e.loss_sum for e in events] == [50.0, 40.0, 30.0]


def test_collective_events_take_the_last_rank_of_each_step():
    ranks = [[{"ended": 11.0, "loss": 2.0, "tokens": 8}, {"ended": 12.0, "loss": 1.5, "tokens": 8}],
             [{"ended": 11.5, "loss": 2.0, "tokens": 8}, {"ended": 11.9, "loss": 1.5, "tokens": 8}]]
    events = analysis.collective_events(ranks)
    assert [(e.t, e.loss_sum, e.tokens) for e in events] == [(0.0, 16.0, 8), (0.5, 12.0, 8)]


def test_curve_smooths_over_a_window_weighted_by_tokens_and_finds_the_first_crossing():
    events = [Event(1.0, 40.0, 10), Event(2.0, 30.0, 10), Event(3.0, 10.0, 30), Event(4.0, 40.0, 10)]
    points = analysis.curve(events, window=2)
    assert points == [(1.0, 4.0), (2.0, 3.5), (3.0, 1.0), (4.0, 1.25)]
    assert analysis.time_to_loss(points, 1.25) == 3.0
    assert analysis.time_to_loss(points, 3.5) == 2.0
    assert analysis.time_to_loss(points, 0.5) is None
    # Within bsp's parity with collective dp, a loss counts as reached (summation order only).
    assert analysis.time_to_loss(points, 1.0 - 0.5e-5) == 3.0
    assert analysis.time_to_loss(points, 1.0 - 2e-5) is None


def test_rows_and_table_show_ratios_time_to_target_and_not_reached():
    def run(mode, straggler, losses, dt, staleness=()):
        events = [Event(dt * (i + 1), loss, 1) for i, loss in enumerate(losses)]
        return Run(mode, straggler, len(losses), events, 1, list(staleness))

    measured = [run("collective dp", True, [3, 2, 1.5], 1.0), run("ps bsp", True, [3, 2, 1.5], 2.0, [0] * 6),
                run("ps ssp s=3", True, [3, 1.4, 1.2], 1.5, [0, 2, 4, 6]), run("ps asp", True, [3, 2.5, 2], 0.5)]
    rows = analysis.rows(measured, target=1.5)
    assert [r["vs_collective"] for r in rows] == [1.0, 2.0, 1.5, 0.5]
    assert [r["to_target_s"] for r in rows] == [3.0, 6.0, 3.0, None]
    assert rows[2]["staleness_mean"] == 3 and rows[2]["staleness_max"] == 6 and rows[0]["staleness_mean"] is None
    text = analysis.run_table(rows, "worker 1 sleeps 0.2 s per step", 1.5)
    lines = text.splitlines()
    assert len(lines) == 2 + 4 and "time to bsp's final loss (1.500)" in lines[0]
    assert lines[4] == ("| ps ssp s=3 | worker 1 sleeps 0.2 s per step | 4.5 s | 2250 ms | 1.50x | 1.200 | 3.0 s "
                        "| 3.00 / 6 |")
    assert lines[5].split(" | ")[6] == "not reached"


def test_quick_runs_a_small_job_and_writes_nothing_by_default():
    args = parse(["--quick"])
    assert (args.workers, args.servers, args.steps) == (2, 1, 8)
    assert (args.json, args.docs, args.plot) == ("", "", "")
    full = parse([])
    assert (full.workers, full.servers, full.docs, full.plot) == (4, 2, "docs/benchmarks.md", "docs/ps-loss-wall.png")
