"""Chaos on the training data store (`target: data`): storage faults on the ranks' reads of their
prepared dataset, in a window of job seconds, also on local files (read through the faulty file
system instead of memory maps); the reads wait them out (`data.read_retry_s`)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from chaos.config import ArmedFault, FaultSpec, rank_data_faults, rank_storage_faults
from chaos.storage_faults import FaultyFileSystem, install_on_data
from ckpt.errors import TransientStorageError
from ckpt.storage_errors import ReadRetry
from orchestrator.spec.job_spec import validate_spec
from orchestrator.spec.problems import SpecError
from tests._tokens import counting_tokens, write_token_dataset
from trainer.tokens.reader import TokenDataset

VOCAB = 97


def armed(**fault) -> ArmedFault:
    return ArmedFault.of(FaultSpec(**fault), 0)


def test_data_faults_go_to_every_rank_or_theirs_and_never_to_the_checkpoint_store():
    every = armed(kind="storage_throttle", target="data", at_seconds=5, duration_s=10)
    one = ArmedFault.of(FaultSpec(kind="storage_error", target="data", rank=1, at_seconds=5), 1)
    ckpt = ArmedFault.of(FaultSpec(kind="storage_error", rank=1, op="read"), 2)
    faults = [every, one, ckpt]
    assert rank_data_faults(faults, 0) == [every] and rank_data_faults(faults, 1) == [every, one]
    assert rank_storage_faults(faults, 1, restore=True) == [ckpt]


def test_a_data_fault_on_a_job_without_a_prepared_dataset_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"chaos.faults\[0\].target.*data.source is 'synthetic'"):
        validate_spec({"name": "t", "model": {"preset": "tiny"}, "train": {"steps": 4, "global_batch": 2},
                       "checkpoint": {"url": "file:///tmp/undying-data-faults"},
                       "chaos": {"faults": [{"kind": "storage_throttle", "target": "data", "at_seconds": 1}]}})


def test_a_throttled_window_on_local_data_is_waited_out_and_notified_once(tmp_path):
    write_token_dataset(tmp_path / "data", counting_tokens(3000, VOCAB), VOCAB, shard_tokens=1000)
    retry = ReadRetry(30.0, setting="data.read_retry_s", renews=True, first_s=0.05, cap_s=0.1)
    ds = TokenDataset(str(tmp_path / "data"), retry=retry)
    notices: list[dict] = []
    # The window: job seconds [0, 1.0) of a job that started now.
    plan = install_on_data([ds], notices.append, faults=[armed(kind="storage_throttle", target="data", at_seconds=0,
                                                                duration_s=1.0)], seed=0, started=time.time())
    assert isinstance(ds.fs, FaultyFileSystem)
    started = time.monotonic()
    assert np.array_equal(ds.read(990, 20), counting_tokens(3000, VOCAB)[990:1010])  # no memory map: through fs
    assert time.monotonic() - started >= 0.8  # it waited the window out
    assert len(plan.fired) > 1 and len(notices) == 1 and notices[0]["kind"] == "storage_throttle"
    # Installed again (a new generation's loop): the original file system is wrapped, not the wrapper.
    install_on_data([ds], notices.append, faults=[armed(kind="storage_error", target="data", at_seconds=0,
                                                        duration_s=60)], seed=0, started=time.time())
    assert not isinstance(ds.fs.fs, FaultyFileSystem)
    quick = TokenDataset(str(tmp_path / "data"), retry=ReadRetry(0.3, setting="data.read_retry_s", renews=True))
    install_on_data([quick], notices.append, faults=[armed(kind="storage_error", target="data", at_seconds=0,
                                                           duration_s=60)], seed=0, started=time.time())
    with pytest.raises(TransientStorageError, match="data.read_retry_s=0.3"):
        quick.read(0, 10)


def test_a_data_fault_at_a_step_opens_its_window_at_the_next_read_and_the_rank_waits_it_out(tmp_path):
    import threading

    from orchestrator.rank.loop import RankLoop
    from orchestrator.rank.state import build_engine
    from orchestrator.wire.store import PLAN, RendezvousServer, connect

    write_token_dataset(tmp_path / "data", counting_tokens(3000, VOCAB), VOCAB, shard_tokens=1000)
    spec = validate_spec({
        "name": "df", "model": {"preset": "tiny"}, "train": {"steps": 8, "global_batch": 2, "micro_batch": 1},
        "data": {"source": "tokens", "path": str(tmp_path / "data"), "seq_len": 16, "prefetch_steps": 1},
        "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 100},
        "chaos": {"faults": [{"kind": "storage_throttle", "target": "data", "at_step": 3, "duration_s": 1.0}]}})
    server = RendezvousServer("127.0.0.1")
    controller = server.generation(0)
    controller.set_json(PLAN, {"every": 100, "anchor": 0, "version": 1, "final_step": 8, "tag": "t",
                               "job_started_at": time.time()})
    armed_faults = [ArmedFault.of(f, i) for i, f in enumerate(spec.chaos.faults)]
    loop = RankLoop(spec, build_engine(spec, 0, 1, 1), connect(server.address, 0), 0, 1, threading.Event(),
                    writer_store=connect(server.address, 0))
    outcome = loop.run(8, armed_faults)
    events = controller.drain_events()
    assert outcome["status"] == "done" and outcome["step"] == 8
    steps = {e["step"]: e for e in events if e["type"] == "step"}
    [fault] = [e for e in events if e["type"] == "fault"]  # one notice for the whole window
    assert fault["kind"] == "storage_throttle" and fault["rank"] == 0 and fault["time"] > steps[2]["time"]
    assert sum(e["data_wait_s"] for e in steps.values()) >= 0.8  # the window was waited out


def test_a_gated_fault_opens_its_window_once_when_its_step_comes_and_another_fault_does_not_reopen_it(tmp_path):
    write_token_dataset(tmp_path / "data", counting_tokens(3000, VOCAB), VOCAB, shard_tokens=1000)
    ds = TokenDataset(str(tmp_path / "data"))  # no retry: each refused read raises
    step = {"done": 0}
    opens = {0: 3, 1: 5}
    faults = [ArmedFault.of(FaultSpec(kind="storage_throttle", target="data", duration_s=0.3), 0),
              ArmedFault.of(FaultSpec(kind="storage_error", target="data", nth=1), 1)]
    notices: list[dict] = []
    install_on_data([ds], notices.append, faults=faults, seed=0, started=time.time(),
                    gate=lambda fault: opens[fault.id] <= step["done"])
    assert len(ds.read(0, 10)) == 10  # before step 3: nothing acts, nothing is counted
    step["done"] = 3
    with pytest.raises(OSError, match="injected storage_throttle"):
        ds.read(0, 10)  # the throttle's window opens at this read
    time.sleep(0.35)
    assert len(ds.read(0, 10)) == 10  # and closes 0.3 s later
    step["done"] = 5  # the second fault comes due: its first read fails, the first fault stays closed
    with pytest.raises(OSError, match="injected storage_error"):
        ds.read(0, 10)
    assert len(ds.read(0, 10)) == 10
    assert [n["kind"] for n in notices] == ["storage_throttle", "storage_error"]


def test_a_fired_data_fault_from_a_step_is_not_armed_again_but_one_in_job_seconds_is():
    from types import SimpleNamespace

    from orchestrator.controller.fault_clock import FaultClock
    from orchestrator.wire.messages import FaultFired

    spec = SimpleNamespace(chaos=SimpleNamespace(faults=[
        FaultSpec(kind="storage_throttle", target="data", at_step=60, duration_s=12),
        FaultSpec(kind="storage_throttle", target="data", at_seconds=30, duration_s=12)]))
    clock = FaultClock(spec, workers=None, clock=lambda: 0.0, log=lambda line: None)
    for fault_id in (0, 1):
        clock.on_fired(FaultFired(fault_id=fault_id, kind="storage_throttle", rank=0, time=1.0))
    assert [f.id for f in clock.armed()] == [1]  # a recovery past step 60 must not meet the outage again
