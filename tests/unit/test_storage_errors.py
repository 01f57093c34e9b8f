"""Storage read errors: transient vs corrupt as s3fs/botocore really raise them, and the bounded,
jittered retry of the transient ones (clock and sleep injected: no test waits)."""

from __future__ import annotations

import dataclasses
import errno
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from chaos.storage_rules import slow_down
from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint, TransientStorageError
from ckpt.reader import read_slices
from ckpt.storage import Storage
from ckpt.storage_errors import CORRUPT, TRANSIENT, ReadRetry, classify
from tests._checkpoints import make_state, save_checkpoint
from trainer.state_slices import TensorSlice

botocore = pytest.importorskip("botocore.exceptions")
s3fs_errors = pytest.importorskip("s3fs.errors")


def _s3(code: str, status: int) -> BaseException:
    """An S3 error reply, translated the way s3fs translates it before raising it."""
    response = {"Error": {"Code": code, "Message": f"{code} happened"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return s3fs_errors.translate_boto_error(botocore.ClientError(response, "GetObject"))


@pytest.mark.parametrize(("code", "status", "verdict"), [
    ("SlowDown", 503, TRANSIENT), ("ServiceUnavailable", 503, TRANSIENT), ("InternalError", 500, TRANSIENT),
    ("BadGateway", 502, TRANSIENT), ("GatewayTimeout", 504, TRANSIENT), ("RequestTimeout", 400, TRANSIENT),
    ("TooManyRequests", 429, TRANSIENT), ("NoSuchKey", 404, CORRUPT), ("InvalidRange", 416, CORRUPT),
    ("NoSuchBucket", 404, TRANSIENT),  # the store's location missing: nothing proven about an object in it
    ("AccessDenied", 403, None), ("InvalidArgument", 400, None),
])
def test_s3_replies_as_s3fs_raises_them(code, status, verdict):
    err = _s3(code, status)
    assert isinstance(err, OSError)  # what reaches ckpt: builtin exceptions, the reply as their cause
    assert classify(err) == verdict


def test_s3fs_surface_of_throttling_is_an_ebusy_oserror_that_only_the_cause_explains():
    err = _s3("SlowDown", 503)
    assert type(err) is OSError and err.errno == errno.EBUSY  # the errno alone would not say "throttled"
    assert classify(err) == TRANSIENT
    injected = slow_down("read", "injected storage_throttle")  # chaos raises the same shape
    assert injected.errno == errno.EBUSY and injected.__cause__.response["Error"]["Code"] == "SlowDown"
    assert classify(injected) == TRANSIENT


@pytest.mark.parametrize("err", [
    botocore.EndpointConnectionError(endpoint_url="http://s3:9000"),
    botocore.ReadTimeoutError(endpoint_url="http://s3:9000"),
    botocore.ConnectTimeoutError(endpoint_url="http://s3:9000"),
    botocore.ResponseStreamingError(error="connection broken"),
    ConnectionResetError(errno.ECONNRESET, "reset by peer"), TimeoutError("timed out"),
    OSError(errno.EIO, "I/O error"), OSError(errno.ESTALE, "stale file handle"),
])
def test_connection_failures_and_flaky_file_systems_are_transient(err):
    assert classify(err) == TRANSIENT


def test_aiohttp_disconnects_are_transient():
    aiohttp = pytest.importorskip("aiohttp")
    assert classify(aiohttp.ServerDisconnectedError()) == TRANSIENT


@pytest.mark.parametrize(("err", "verdict"), [
    (FileNotFoundError(errno.ENOENT, "no such file"), CORRUPT),
    (PermissionError(errno.EACCES, "denied"), None),
    (ValueError("a bug"), None),
])
def test_missing_objects_are_proof_and_other_errors_are_neither(err, verdict):
    assert classify(err) == verdict


def test_only_explicit_causes_count_and_a_callers_proof_wins():
    try:
        try:
            raise OSError(errno.EIO, "the write failed")
        except OSError:  # while handling it, the read-back found a torn manifest: its own finding
            raise CorruptCheckpoint("step 20: the manifest is not JSON") from None
    except CorruptCheckpoint as err:
        assert isinstance(err.__context__, OSError)
        assert classify(err) == CORRUPT
    wrapped = RuntimeError("while reading")
    wrapped.__cause__ = ConnectionResetError()
    assert classify(wrapped) == TRANSIENT


class _Clock:
    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _retry(clock: _Clock, budget: float, seed: int = 0) -> ReadRetry:
    return ReadRetry(budget, first_s=0.2, cap_s=10.0, clock=lambda: clock.now, sleep=clock.sleep,
                     rng=random.Random(seed))


def test_transient_errors_are_retried_with_growing_jittered_waits_until_the_read_succeeds():
    clock, calls = _Clock(), []

    def read():
        calls.append(clock.now)
        if len(calls) <= 6:
            raise _s3("SlowDown", 503)
        return b"bytes"

    assert _retry(clock, 120.0).call(read, "step 20: shard") == b"bytes"
    assert len(calls) == 7 and len(clock.sleeps) == 6
    for attempt, wait in enumerate(clock.sleeps):
        ceiling = min(10.0, 0.2 * 2 ** attempt)
        assert ceiling / 2 <= wait <= ceiling  # exponential envelope, jittered inside it
    other = _Clock()
    _retry(other, 120.0, seed=1).call(_fails_then(6, b"x"), "w")
    assert other.sleeps != clock.sleeps  # jitter: two readers do not retry in lockstep


def _fails_then(n: int, value):
    left = [n]

    def read():
        if left[0]:
            left[0] -= 1
            raise TimeoutError("read timed out")
        return value

    return read


def test_the_retry_is_bounded_by_its_budget_and_names_the_read_and_the_cause():
    clock = _Clock()

    def never():
        raise _s3("InternalError", 500)

    with pytest.raises(TransientStorageError, match=r"step 30: bytes 0\.\.64.*read_retry_s=30.*InternalError") as info:
        _retry(clock, 30.0).call(never, "step 30: bytes 0..64 of shard-r00000.bin")
    assert 30.0 <= clock.now <= 30.0 + 1e-9  # the last wait is cut to the budget
    assert max(clock.sleeps) <= 10.0 and len(clock.sleeps) > 5
    assert isinstance(info.value, OSError) and classify(info.value.__cause__) == TRANSIENT


def test_a_long_transfer_after_a_throttled_try_is_reading_time_not_failing_time():
    # A large restore under steady throttling: every piece is refused once (SlowDown), then its
    # retry streams 16 MiB for 20 s. The retries all work, so the 30 s budget must not run out.
    clock = _Clock()
    retry = _retry(clock, 30.0)

    def piece():
        tried = []

        def read():
            tried.append(clock.now)
            if len(tried) == 1:
                raise _s3("SlowDown", 503)
            clock.now += 20.0  # the answering transfer
            return b"piece"

        return read

    assert all(retry.call(piece(), f"piece {i}") == b"piece" for i in range(10))
    assert clock.now > 200.0 and sum(clock.sleeps) < 3.0  # 200 s of reading, a few seconds of waits
    clock.now += 1.0  # a retry that fails again after a long try: that try was failing time

    def slow_failures():
        clock.now += 15.0
        raise TimeoutError("read timed out")

    with pytest.raises(TransientStorageError, match=r"kept failing reads for (2[89]|3\d)\.\d s"):
        retry.call(slow_failures, "a piece that times out")


def test_errors_that_are_not_transient_pass_at_once_and_budget_zero_never_waits():
    clock = _Clock()
    with pytest.raises(FileNotFoundError):
        _retry(clock, 120.0).call(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "m")
    with pytest.raises(PermissionError):
        _retry(clock, 120.0).call(lambda: (_ for _ in ()).throw(_s3("AccessDenied", 403)), "m")
    with pytest.raises(TransientStorageError):
        _retry(clock, 0.0).call(_fails_then(1, b""), "m")
    assert clock.sleeps == []


def test_one_budget_for_all_the_reads_made_through_one_retry(tmp_path):
    # A restore whose manifest read waits out 20 s of a flapping store has 10 s left for its pieces,
    # not another 30 s per read: the restore ends within its healthy time plus read_retry_s.
    catalog = Catalog(Storage(f"file://{tmp_path}/job"))
    save_checkpoint(catalog, 10, make_state(10), world=1)
    clock, storage = _Clock(), catalog.storage
    outage = {"manifest": (0.0, 20.0), "range": None}
    real_read, real_range = storage.read, storage.read_range_into

    def down(what: str) -> None:
        if outage[what] is None:
            outage[what] = (clock.now, clock.now + 20.0)  # the pieces' outage starts at their first read
        start, end = outage[what]
        if clock.now < end:
            raise _s3("SlowDown", 503)

    storage.read = lambda path: (down("manifest"), real_read(path))[1]
    storage.read_range_into = lambda *args: (down("range"), real_range(*args))[1]
    wanted = [TensorSlice("model/w", torch.float32, (8, 4), (0, 0), (8, 4))]
    retry = _retry(clock, 30.0)
    with pytest.raises(TransientStorageError, match=r"kept failing reads for 30\.0 s \(checkpoint.read_retry_s=30\)"):
        read_slices(catalog, 10, wanted, threads=1, retry=retry)
    assert outage["range"][0] >= 20.0 and clock.now == pytest.approx(30.0)  # not 20 + 30: one budget
    # The spent one gives up at the next failure; a fresh() one (same settings, unspent budget) waits it out.
    outage.update(manifest=(clock.now, clock.now + 5.0), range=(0.0, 0.0))
    with pytest.raises(TransientStorageError):
        read_slices(catalog, 10, wanted, threads=1, retry=retry)
    again = retry.fresh()
    assert (again.budget_s, again.clock, again.sleep) == (retry.budget_s, retry.clock, retry.sleep)
    assert read_slices(catalog, 10, wanted, threads=1, retry=again)[0].tensor.shape == (8, 4)


def test_reads_failing_together_spend_the_budget_once():
    retry = ReadRetry(0.4, first_s=0.05, cap_s=0.05)
    started = time.monotonic()

    def never():
        raise TimeoutError("read timed out")

    with ThreadPoolExecutor(4) as pool:
        errors = [f.exception() for f in [pool.submit(retry.call, never, f"piece {i}") for i in range(4)]]
    assert all(isinstance(e, TransientStorageError) for e in errors)
    assert 0.4 <= time.monotonic() - started < 1.0  # side by side, not 4 x 0.4 s and not 0.4 / 4


def test_an_interrupt_gives_a_retried_read_up_within_half_a_second_of_its_waits():
    clock, asked = _Clock(), []

    class GivenUp(Exception):
        pass

    def interrupt() -> None:
        asked.append(clock.now)
        if clock.now >= 3.0:  # a later restore came to the rank 3 s into the retries
            raise GivenUp

    retry = dataclasses.replace(_retry(clock, 120.0), interrupt=interrupt)
    with pytest.raises(GivenUp):
        retry.call(_fails_then(1000, b""), "step 40: shard")
    assert 3.0 <= clock.now <= 3.5 and max(clock.sleeps) <= 0.5
    assert not retry.renews and retry.setting == "checkpoint.read_retry_s"


def test_one_outage_keeps_a_renewing_budget_for_the_whole_block():
    # A step of a mixture reads its datasets in turn: each failing ~20 s then answering must not
    # renew the budget between them, or one step's wait would grow with the number of datasets.
    clock = _Clock()
    retry = dataclasses.replace(_retry(clock, 30.0), renews=True, setting="data.read_retry_s")

    def dataset_read():
        ends = clock.now + 20.0

        def read():
            if clock.now < ends:
                raise _s3("SlowDown", 503)
            return b"ok"

        return read

    with pytest.raises(TransientStorageError, match=r"data.read_retry_s=30"), retry.one_outage():
        for _ in range(3):  # three datasets of one step
            assert retry.call(dataset_read(), "tokens") == b"ok"
    assert 30.0 <= clock.now < 41.0  # the second dataset's wait took the rest of the step's one budget
    again = dataset_read()  # the block is over: the next step's outage has the whole budget again
    assert retry.call(again, "tokens") == b"ok"


def test_a_renewing_budget_gives_each_failing_spell_the_whole_budget():
    clock = _Clock()
    retry = dataclasses.replace(_retry(clock, 30.0), renews=True, setting="data.read_retry_s")
    for _ in range(4):  # four outages of about 20 s each, 80 s in all
        ends = clock.now + 20.0
        read = _fails_then(1000, b"ok")
        assert retry.call(lambda read=read, ends=ends: read() if clock.now < ends else b"ok", "tokens") == b"ok"
    with pytest.raises(TransientStorageError, match=r"data.read_retry_s=30"):
        retry.call(_fails_then(1000, b""), "tokens")
