"""The GPU check's process-group part without a GPU: host-side expected values, the merge of
every rank's verdicts, the rows (a world of one claims no collective), and the worker itself
on gloo (a world of one in this process; a world of two spawned, heavy)."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from bench.gpu_check import collectives, engine_parity
from bench.gpu_check.collectives import OPS, collective_rows, expected, merge, ops_for
from bench.gpu_check.verdict import FAIL, NOT_TESTED, OK


def test_expected_values_by_hand_for_two_ranks():
    # rank 0 contributes [1, 2, 3, 1, ...], rank 1 twice that
    assert expected("all_reduce_sum", 0, 2, 4).tolist() == [3, 6, 9, 3]
    assert expected("all_reduce_max", 1, 2, 4).tolist() == [2, 4, 6, 2]
    assert expected("all_gather", 0, 2, 2).tolist() == [1, 2, 2, 4]
    assert expected("reduce_scatter", 0, 2, 2).tolist() == [3, 6]  # chunk 0 of [1,2,3,1] + [2,4,6,2]
    assert expected("reduce_scatter", 1, 2, 2).tolist() == [9, 3]
    assert expected("broadcast", 0, 2, 3).tolist() == [2, 4, 6]  # from the last rank
    assert expected("send_recv", 0, 2, 3).tolist() == [2, 4, 6]  # from rank (0 - 1) % 2
    assert expected("send_recv", 1, 3, 3).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="unknown collective"):
        expected("all_to_all", 0, 2, 2)


def test_bf16_is_checked_only_while_its_sums_are_exact():
    assert collectives.dtypes_for(8) == (torch.float32, torch.bfloat16)
    assert collectives.dtypes_for(12) == (torch.float32, torch.bfloat16)  # largest sum 234
    assert collectives.dtypes_for(16) == (torch.float32,)
    big = expected("all_reduce_sum", 0, 12, 3, torch.bfloat16)
    assert big.tolist() == [78, 156, 234]


def report(bad: dict | None = None, error: str | None = None, world: int = 2) -> dict:
    return {"problems": {op: (bad or {}).get(op) for op in ops_for(world)}, "error": error}


def test_merge_names_the_wrong_ranks_and_a_dead_one():
    got = merge({0: report(), 1: report({"reduce_scatter": "float32 n=1021: 7 of 1021 elements wrong"})}, 2, "nccl")
    assert got["ops"]["all_reduce_sum"] == {"ok": True, "bad": {}}
    assert got["ops"]["reduce_scatter"]["bad"] == {"1": "float32 n=1021: 7 of 1021 elements wrong"}
    dead = merge({0: report(), 1: None}, 2, "nccl", launch_error="ProcessExitedException: process 1 terminated")
    assert all(not v["ok"] and "died" in v["bad"]["1"] for v in dead["ops"].values())
    rows = collective_rows(dead)
    assert rows[0].status == FAIL and rows[1].check.strip() == "errors" and "terminated" in rows[1].measured


def test_world_of_two_rows_are_judged_per_op():
    rows = collective_rows(merge({0: report(), 1: report({"send_recv": "float32 n=1021: 1021 of 1021"})}, 2, "nccl"))
    status = {row.check.strip(): row.status for row in rows}
    assert status["send_recv"] == FAIL and status["nccl process group"] == FAIL
    assert all(status[op] == OK for op in OPS if op != "send_recv")
    assert status["engine zero3"] == OK and "reproduce" in next(r for r in rows if "zero3" in r.check).measured


def test_world_of_one_claims_no_collective():
    rows = collective_rows(merge({0: report(world=1)}, 1, "nccl"))
    assert rows[0].status == OK and "world 1" in rows[0].measured
    ops = {row.check.strip(): row for row in rows[1:]}
    assert set(ops) == set(OPS) | set(engine_parity.LAYOUTS)
    assert all(row.status == NOT_TESTED for row in ops.values())
    assert "equals the input" in ops["reduce_scatter"].measured


def test_the_worker_runs_every_op_on_gloo_in_a_world_of_one():
    with tempfile.TemporaryDirectory() as tmp:
        collectives.worker(0, 1, "gloo", f"tcp://127.0.0.1:{collectives.free_port()}", tmp)
        got = json.loads(Path(tmp, "rank0.json").read_text())
    assert got["error"] is None
    assert got["problems"] == {op: None for op in ops_for(1)}


@pytest.mark.heavy
def test_two_spawned_gloo_ranks_exchange_exact_values():
    got = collectives.run_collectives(2, "gloo")
    assert got["launch_error"] is None and got["errors"] == {}
    assert all(v["ok"] for v in got["ops"].values()) and set(got["ops"]) == set(OPS) | set(engine_parity.LAYOUTS)
    assert all(row.status == OK for row in collective_rows(got))


def test_rank_processes_ask_nccl_to_abort_communicators_not_kill_the_process(monkeypatch):
    from orchestrator.rank.comm_abort import CommSockets, set_nccl_error_handling

    env = {}
    set_nccl_error_handling(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    chosen = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    set_nccl_error_handling(chosen)
    assert chosen == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # an operator's choice stands
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "")  # so that the teardown restores what was there
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    with CommSockets.capture():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


def test_engine_parity_judges_losses_parameters_and_ddp_replicas():
    ref = {"losses": [5.5, 5.4], "sum_of_squares": 100.0}
    assert engine_parity.compare("engine ddp", [5.5, 5.4], [50.0, 50.0], ref) is None
    assert engine_parity.compare("engine zero3", [5.5, 5.4 * (1 + 5e-5)], [30.0, 70.0], ref) is None
    assert "step 1 loss" in engine_parity.compare("engine zero3", [5.5, 5.41], [50.0, 50.0], ref)
    assert "sum of squares" in engine_parity.compare("engine zero3", [5.5, 5.4], [50.0, 50.01], ref)
    assert "replicas differ" in engine_parity.compare("engine ddp", [5.5, 5.4], [49.9999, 50.0001], ref)


def test_engine_parity_runs_in_a_world_of_one_on_gloo():
    device = torch.device("cpu")
    ref = engine_parity.reference(1, device)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{collectives.free_port()}",
                                         rank=0, world_size=1)
    try:
        assert [engine_parity.layout_problem(name, 0, 1, device, ref) for name in engine_parity.LAYOUTS] == [None,
                                                                                                            None]
    finally:
        torch.distributed.destroy_process_group()
