"""A data store's outage costs a wait, not a rollback: remote token reads are retried per outage
(`data.read_retry_s`), the training thread beats while it waits for them, and the hang watchdog
and the collective timeout leave such a rank alone for the budget.

The store here is fsspec's in-memory file system (remote to the reader: no memory maps) whose
`cat_file` fails transiently as the S3 client surfaces throttling (OSError EBUSY)."""

from __future__ import annotations

import errno
import threading
import time
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ckpt.errors import TransientStorageError
from ckpt.storage_errors import ReadRetry, data_read_retry
from orchestrator.controller.save_watch import SaveWatch, data_outage_s
from orchestrator.controller.timeouts import Observed, derive
from orchestrator.rank.beats import Beats
from orchestrator.rank.loop import RankLoop
from orchestrator.rank.state import build_engine
from orchestrator.spec.job_spec import validate_spec
from orchestrator.wire.messages import Heartbeat
from orchestrator.wire.store import PLAN, RendezvousServer, connect, heartbeat_key
from tests._tokens import counting_tokens, write_token_dataset
from trainer.config import DataConfig
from trainer.data import make_cursor
from trainer.prefetch import StepPrefetcher
from trainer.tokens.format import TokenFormatError
from trainer.tokens.reader import TokenDataset

VOCAB = 97


class Clock:
    """time.monotonic and time.sleep for a ReadRetry, with no waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Outage:
    """Wraps a file system's `cat_file` (fsspec's instances are shared: through `monkeypatch`, so
    the next test gets it back): reads fail with EBUSY while `down()` says so."""

    def __init__(self, monkeypatch, fs, down) -> None:
        self.real, self.down, self.failures = fs.cat_file, down, 0
        monkeypatch.setattr(fs, "cat_file", self)

    def __call__(self, *args, **kwargs):
        if self.down():
            self.failures += 1
            raise OSError(errno.EBUSY, "Please reduce your request rate (SlowDown)")
        return self.real(*args, **kwargs)

    def __get__(self, instance, owner):  # installed on a class: bound like the method it replaces
        return self if instance is None else (lambda *args, **kwargs: self(instance, *args, **kwargs))


@pytest.fixture
def remote_dataset() -> str:
    url = f"memory://data-{uuid.uuid4().hex}"
    write_token_dataset(url, counting_tokens(4000, VOCAB), VOCAB, shard_tokens=1000)
    return url


def test_a_read_the_store_fails_for_a_while_is_retried_and_returns_the_tokens(monkeypatch, remote_dataset):
    clock = Clock()
    retry = ReadRetry(60.0, setting="data.read_retry_s", renews=True, clock=lambda: clock.now, sleep=clock.sleep)
    ds = TokenDataset(remote_dataset, retry=retry)
    outage = Outage(monkeypatch, ds.fs, lambda: clock.now < 20.0)  # down for 20 s of the retry's clock
    assert np.array_equal(ds.read(950, 100), counting_tokens(4000, VOCAB)[950:1050])  # across two shards
    assert outage.failures > 3 and clock.now >= 20.0


def test_each_outage_gets_the_whole_budget_and_one_past_it_fails_naming_the_field(monkeypatch, remote_dataset):
    clock = Clock()
    retry = ReadRetry(30.0, setting="data.read_retry_s", renews=True, clock=lambda: clock.now, sleep=clock.sleep)
    ds = TokenDataset(remote_dataset, retry=retry)
    start = {"at": 0.0, "for": 25.0}
    Outage(monkeypatch, ds.fs, lambda: start["at"] <= clock.now < start["at"] + start["for"])
    for _ in range(3):  # three outages of 25 s each: 75 s in all, each within the 30 s budget
        start["at"] = clock.now
        assert len(ds.read(10, 5)) == 5
    start["at"], start["for"] = clock.now, 45.0
    with pytest.raises(TransientStorageError, match=r"reading tokens \[10, 15\) of .*data.read_retry_s=30"):
        ds.read(10, 5)


def test_without_a_retry_or_on_a_short_read_nothing_is_retried(monkeypatch, remote_dataset):
    clock = Clock()
    ds = TokenDataset(remote_dataset)
    retried = TokenDataset(remote_dataset, retry=ReadRetry(60.0, renews=True, clock=lambda: clock.now,
                                                             sleep=clock.sleep))
    with monkeypatch.context() as patch:
        outage = Outage(patch, ds.fs, lambda: True)
        with pytest.raises(OSError, match="SlowDown"):
            ds.read(0, 10)
    assert outage.failures == 1
    monkeypatch.setattr(retried.fs, "cat_file", lambda *args, **kwargs: b"\x00")  # a truncated shard: proof
    with pytest.raises(TokenFormatError, match="truncated"):
        retried.read(0, 10)
    assert clock.now == 0.0


def test_the_prefetcher_calls_on_wait_with_the_wait_so_far_while_a_step_is_in_flight():
    waits: list[float] = []
    ready = threading.Event()

    def load(key: tuple) -> tuple:
        time.sleep(0.4 if key[0] == 1 else 0)
        if key[0] == 2:
            ready.set()
        return key

    prefetcher = StepPrefetcher(load, steps=1)
    prefetcher.on_wait, prefetcher.wait_tick_s = waits.append, 0.05
    assert prefetcher.get((0,)) == (0,)  # not prefetched: loaded by the thread too; step 1 goes ahead, slowly
    waits.clear()  # a slow start of the thread may have made step 0 wait too
    assert prefetcher.get((1,)) == (1,)
    assert len(waits) >= 3 and waits == sorted(waits) and 0.04 < waits[0] < waits[-1] < 3.0
    assert ready.wait(10)  # step 2 is in: no wait
    count = len(waits)
    assert prefetcher.get((2,)) == (2,) and len(waits) == count
    prefetcher.close()


def test_a_load_that_raises_timeout_error_is_raised_not_waited_on_forever():
    prefetcher = StepPrefetcher(lambda key: (_ for _ in ()).throw(TimeoutError("read timed out")), steps=1)
    prefetcher.on_wait, prefetcher.wait_tick_s = lambda waited: None, 0.01
    with pytest.raises(TimeoutError, match="read timed out"):
        prefetcher.get((0,))
    prefetcher.close()


def test_a_rank_waiting_for_its_data_beats_with_how_long_it_has_waited():
    written = []
    beats = Beats(SimpleNamespace(set_json=lambda key, value: written.append(Heartbeat.from_json(value))), rank=3,
                  heartbeat_s=1.0, saved_bytes=lambda: 0, done_step=lambda: 4)
    beats.while_reading(2.0)  # the call's first step waits too
    assert written[-1].step == 4 and written[-1].data_wait_s == 2.0
    beats.after_step(5, 0.2)
    beats.while_reading(7.5)
    assert written[-1].step == 5 and written[-1].data_wait_s == 7.5 and written[-1].compute_s == 0.2
    beats.saving(6)
    beats.while_blocked()  # a later wait on a save does not carry the data wait
    assert written[-1].data_wait_s == 0.0 and written[-1].saving == 6


def test_a_cursor_waiting_out_its_data_stores_outage_reports_the_wait_and_returns_the_samples(
        monkeypatch, remote_dataset):
    cfg = DataConfig(source="tokens", path=remote_dataset, seq_len=16, prefetch_steps=1)
    reference = make_cursor(cfg, VOCAB)
    want = [reference.microbatches(step, 4, 2, 0, 1, record=False) for step in (0, 2)]
    retry = ReadRetry(30.0, setting="data.read_retry_s", renews=True, first_s=0.02, cap_s=0.05)
    cursor = make_cursor(cfg, VOCAB, read_retry=retry)
    seen: list[float] = []
    cursor.on_wait = seen.append
    first = cursor.microbatches(0, 4, 2, 0, 1)
    cursor.prefetcher.wait_tick_s = 0.02
    down_until = time.monotonic() + 0.6
    outage = Outage(monkeypatch, cursor.datasets[0].fs, lambda: time.monotonic() < down_until)
    cursor.microbatches(1, 4, 2, 0, 1)  # step 2 goes ahead into the outage
    second = cursor.microbatches(2, 4, 2, 0, 1)  # retried, returned intact
    assert outage.failures > 0 and max(seen) > 0.3
    for got, expected in zip([first, second], want, strict=True):
        assert [(torch.equal(a.input_ids, b.input_ids), torch.equal(a.labels, b.labels))
                for a, b in zip(got, expected, strict=True)] == [(True, True)] * len(expected)
    cursor.close()


def test_a_rank_loop_waiting_out_its_data_store_beats_and_leaves_at_an_abort(monkeypatch, remote_dataset, tmp_path):
    spec = validate_spec({
        "name": "wait", "model": {"preset": "tiny"}, "train": {"steps": 10**6, "global_batch": 2, "micro_batch": 1},
        "data": {"source": "tokens", "path": remote_dataset, "seq_len": 16, "prefetch_steps": 1, "read_retry_s": 60},
        "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 10**6}})
    server = RendezvousServer("127.0.0.1")
    controller = server.generation(0)
    controller.set_json(PLAN, {"every": 10**6, "anchor": 0, "version": 1, "final_step": 10**6, "tag": "t",
                               "job_started_at": time.time()})
    engine = build_engine(spec, 0, 1, 1)
    down = threading.Event()
    Outage(monkeypatch, engine.data.datasets[0].fs, down.is_set)
    abort, outcome = threading.Event(), {}
    loop = RankLoop(spec, engine, connect(server.address, 0), 0, 1, abort, writer_store=connect(server.address, 0))
    trainer = threading.Thread(target=lambda: outcome.update(loop.run(10**6, [])), daemon=True)
    trainer.start()
    deadline = time.monotonic() + 60
    while (controller.get_json(heartbeat_key(0)) or {}).get("step", -1) < 2:
        assert time.monotonic() < deadline and trainer.is_alive(), f"the rank never trained 3 steps: {outcome}"
        time.sleep(0.05)
    down.set()  # the store stops answering: the rank waits for its next step's data, and beats
    while (controller.get_json(heartbeat_key(0)) or {}).get("data_wait_s", 0.0) < 1.0:
        assert time.monotonic() < deadline and trainer.is_alive(), f"no data-wait beat: {outcome}"
        time.sleep(0.05)
    abort.set()
    trainer.join(5)
    assert outcome["status"] == "aborted" and outcome["error"] == "abort requested by the controller", outcome
    down.clear()
    engine.data.close(wait=True)


def test_the_watchdog_counts_a_rank_waiting_for_its_data_as_busy_within_the_outage_allowance():
    watch, limit = SaveWatch(data_outage_s=60.0), 10.0
    watch.observe(0, Heartbeat(10, 100.0, 0.2), now=0.0)
    watch.observe(1, Heartbeat(10, 100.0, 0.2), now=0.0)
    assert not watch.busy(limit, now=5.0) and watch.stalled(limit, now=5.0) is None
    watch.observe(1, Heartbeat(10, 130.0, 0.2, data_wait_s=30.0), now=30.0)
    assert watch.busy(limit, now=35.0) and watch.reading(limit, now=35.0) == {1: 30.0}
    assert not watch.busy(limit, now=41.0)  # it stopped beating: its wait is judged like any other
    watch.observe(1, Heartbeat(10, 175.0, 0.2, data_wait_s=75.0), now=75.0)
    assert not watch.busy(limit, now=76.0)  # past the store's allowance and the limit: a hang
    assert "rank(s) [1] waited 75 s for a step's data" in watch.stalled(limit, now=76.0)
    watch.observe(1, Heartbeat(11, 180.0, 0.2), now=80.0)
    assert not watch.reading(limit, now=81.0) and watch.stalled(limit, now=81.0) is None  # the step came
    assert not SaveWatch().busy(limit, now=0.0)


def test_the_collective_timeout_outlasts_a_data_outage_for_prepared_datasets():
    base = {"name": "t", "model": {"preset": "tiny"}, "train": {"steps": 4, "global_batch": 2},
            "checkpoint": {"url": "file:///tmp/undying-data-retry"}}
    synthetic = validate_spec(base)
    tokens = validate_spec({**base, "data": {"source": "tokens", "path": "s3://bucket/tokens", "read_retry_s": 300}})
    seen = Observed(median_step_s=1.0, first_step_s=5.0, peak_flops_per_rank=1e12)
    assert derive(synthetic.elastic, synthetic, 2, seen).collective_s == 60.0
    limits = derive(tokens.elastic, tokens, 2, seen)
    assert limits.collective_s == 300.0 + 10.0  # the outage, and the hang limit after it
    assert data_read_retry(tokens.data).budget_s == 300.0 and data_read_retry(tokens.data).renews
    assert data_outage_s(tokens) == 300.0 and data_outage_s(synthetic) == 0.0


def test_a_look_at_a_step_ahead_waits_for_it_there_and_reads_nothing_twice():
    loads: list[tuple] = []
    prefetcher = StepPrefetcher(lambda key: loads.append(key) or key, steps=2)
    prefetcher.on_wait = lambda waited: None
    assert prefetcher.get((0,)) == (0,)
    assert prefetcher.peek((1,)) == (1,) and prefetcher.peek((9,)) is None
    assert prefetcher.get((1,)) == (1,) and prefetcher.get((2,)) == (2,)
    assert sorted(set(loads)) == sorted(loads)  # every step read once
    prefetcher.close()


def test_the_validation_windows_are_read_waiting_reporting_and_an_abort_ends_the_wait(monkeypatch, remote_dataset):
    from orchestrator.rank.loop import AbortedWhileWaiting, Evaluator

    spec = validate_spec({"name": "ev", "model": {"preset": "tiny"}, "train": {"steps": 4, "global_batch": 2},
                          "data": {"seq_len": 16}, "checkpoint": {"url": "file:///tmp/undying-eval-wait"},
                          "eval": {"path": remote_dataset, "every_steps": 2, "windows": 4}})
    reference = Evaluator(spec).windows()
    # The windows are read on a thread of their own, where fsspec makes a file system instance of
    # its own (its cache is per thread): the outage is the class's.
    cls = type(TokenDataset(remote_dataset).fs)
    down_until = time.monotonic() + 2.5
    outage = Outage(monkeypatch, cls, lambda: time.monotonic() < down_until)
    waits: list[float] = []
    windows = Evaluator(spec).windows(waits.append)
    assert outage.failures > 0 and len(waits) >= 1 and [w.tolist() for w in windows] == [w.tolist() for w in reference]

    def abort(waited: float) -> None:
        raise AbortedWhileWaiting("abort requested by the controller")

    down_until = time.monotonic() + 30
    started = time.monotonic()
    try:
        with pytest.raises(AbortedWhileWaiting):
            Evaluator(spec).windows(abort)
        assert time.monotonic() - started < 5
    finally:
        down_until = 0.0  # the read left behind ends at its next retry


def test_a_steps_windows_are_read_as_one_batch_retried_whole(monkeypatch, remote_dataset):
    clock = Clock()
    ds = TokenDataset(remote_dataset, retry=ReadRetry(60.0, renews=True, clock=lambda: clock.now, sleep=clock.sleep))
    spans = [(0, 17), (990, 20), (3980, 20)]  # the second across two shards
    outage = Outage(monkeypatch, ds.fs, lambda: clock.now < 5.0)
    got = ds.read_many(spans)
    assert outage.failures >= 1 and clock.now >= 5.0
    assert all(np.array_equal(g, counting_tokens(4000, VOCAB)[s:s + n]) for g, (s, n) in zip(got, spans, strict=True))
    with pytest.raises(IndexError, match=r"tokens \[3990, 4010\) are outside"):
        ds.read_many([(0, 5), (3990, 20)])


def test_a_batch_reads_again_only_the_ranges_that_failed(monkeypatch, remote_dataset):
    clock = Clock()
    ds = TokenDataset(remote_dataset, retry=ReadRetry(60.0, renews=True, clock=lambda: clock.now, sleep=clock.sleep))
    calls: list[tuple] = []
    real = ds.fs.cat_file

    def flaky(path, start=None, end=None, **kwargs):
        calls.append((path, start))
        if len(calls) == 2:  # the batch's second range fails once
            raise OSError(errno.EBUSY, "Please reduce your request rate (SlowDown)")
        return real(path, start=start, end=end, **kwargs)

    monkeypatch.setattr(ds.fs, "cat_file", flaky)
    spans = [(0, 10), (100, 10), (2500, 10)]
    got = ds.read_many(spans)
    assert len(calls) == 4 and calls[3] == calls[1]  # three ranges, and the failed one once more
    assert all(np.array_equal(g, counting_tokens(4000, VOCAB)[s:s + n]) for g, (s, n) in zip(got, spans, strict=True))


@pytest.mark.parametrize("where", ["memory", "local"])
def test_a_shard_deleted_since_the_start_is_named_as_missing_and_not_retried(tmp_path, where):
    from trainer.tokens.format import TOKENS_SUFFIX

    url = f"memory://data-{uuid.uuid4().hex}" if where == "memory" else f"file://{tmp_path}/data"
    write_token_dataset(url, counting_tokens(4000, VOCAB), VOCAB, shard_tokens=1000)
    clock = Clock()
    ds = TokenDataset(url, retry=ReadRetry(60.0, renews=True, clock=lambda: clock.now, sleep=clock.sleep))
    gone = ds._path(1, TOKENS_SUFFIX)
    ds.fs.rm(gone)
    assert len(ds.read(0, 100)) == 100  # the other shards still read
    for read in (lambda: ds.read(950, 100), lambda: ds.read_many([(1500, 10)])):
        with pytest.raises(TokenFormatError, match=f"{gone.split('/')[-1]}: a file of the dataset .* is missing"):
            read()
    assert clock.now == 0.0  # damage, not an outage: nothing waited


def test_closing_a_cursor_stops_a_read_that_waits_out_an_outage(monkeypatch, remote_dataset):
    from trainer.data import CursorClosed

    cfg = DataConfig(source="tokens", path=remote_dataset, seq_len=16, prefetch_steps=1)
    cursor = make_cursor(cfg, VOCAB, read_retry=ReadRetry(120.0, setting="data.read_retry_s", renews=True))
    Outage(monkeypatch, cursor.datasets[0].fs, lambda: True)  # the store is down for good
    outcome: list = []

    def step() -> None:
        try:
            outcome.append(cursor.microbatches(0, 4, 2, 0, 1))
        except CursorClosed as err:
            outcome.append(err)

    reader = threading.Thread(target=step, daemon=True)
    reader.start()
    time.sleep(0.5)  # retrying by now
    closed_at = time.monotonic()
    cursor.close(wait=False)  # a rank dropping its engine
    reader.join(timeout=5)
    assert not reader.is_alive() and isinstance(outcome[0], CursorClosed)
    assert time.monotonic() - closed_at < 3  # not the 120 s budget
    assert not [t for t in cursor.prefetcher._pool._threads if t.is_alive()]  # the read's thread ended too


def test_a_mixture_step_waits_out_its_datasets_outages_within_one_budget(monkeypatch):
    """A step reads each dataset of a mixture in turn; each failing 20 s then answering must spend
    one 30 s budget, not renew it between them: the watchdog and the process group's timeout allow
    one `data.read_retry_s` per step (the step's reads run inside ReadRetry.one_outage)."""
    urls = [f"memory://data-{uuid.uuid4().hex}" for _ in range(2)]
    for url in urls:
        write_token_dataset(url, counting_tokens(4000, VOCAB), VOCAB, shard_tokens=1000)
    cfg = DataConfig(source="tokens", mixture=[{"path": url, "weight": 1.0} for url in urls], seq_len=16,
                     prefetch_steps=1)
    clock, first_failure = Clock(), {}
    cursor = make_cursor(cfg, VOCAB, read_retry=ReadRetry(30.0, setting="data.read_retry_s", renews=True,
                                                          clock=lambda: clock.now, sleep=clock.sleep))
    assert {s for s, _ in cursor.windows(0, 8, 0, 1)} == {0, 1}  # the step reads both datasets

    def each_dataset_down_for_20_s(real):
        def cat_file(path, *args, **kwargs):
            if path.endswith(".tokens"):
                since = first_failure.setdefault(path.strip("/").split("/")[0], clock.now)
                if clock.now < since + 20.0:
                    raise OSError(errno.EBUSY, "Please reduce your request rate (SlowDown)")
            return real(path, *args, **kwargs)
        return cat_file

    for dataset in cursor.datasets:  # each its own client (trainer.tokens.reader)
        monkeypatch.setattr(dataset.fs, "cat_file", each_dataset_down_for_20_s(dataset.fs.cat_file))
    with pytest.raises(TransientStorageError, match=r"data.read_retry_s=30"):
        cursor.microbatches(0, 8, 2, 0, 1)
    assert len(first_failure) == 2 and clock.now < 41.0
    cursor.close()


def test_a_store_that_ignores_range_requests_is_named_not_taken_for_a_truncated_shard(monkeypatch, remote_dataset):
    from trainer.urls import RangeIgnored

    ds = TokenDataset(remote_dataset)
    whole = ds.fs.cat_file
    monkeypatch.setattr(ds.fs, "cat_file", lambda path, start=None, end=None, **kw: whole(path))
    with pytest.raises(RangeIgnored, match="ignores HTTP Range requests"):
        ds.read(10, 20)  # "prepare the data again" would not help
