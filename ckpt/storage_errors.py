"""Storage read failures judged and retried: a slow store is not a corrupt checkpoint.

`classify(err)` sorts an exception raised by a storage read into
  * "corrupt": proof that the checkpoint's bytes are bad or gone: the object a committed
    manifest names does not exist (FileNotFoundError, S3 404 NoSuchKey), or a range past its
    end was asked for (S3 416 InvalidRange: the object is shorter than the manifest says).
    Checksum mismatches, short reads and manifests that do not parse are found by the callers
    (ckpt.fetch, ckpt.reader) and raised as CorruptCheckpoint directly.
  * "transient": the store did not answer properly, which says nothing about the bytes:
    timeouts, refused or reset connections, HTTP 429 and 5xx, S3 throttling (`SlowDown`),
    and the errnos that local and network file systems give for the same (EIO, EBUSY,
    ETIMEDOUT, ESTALE, ...); and a bucket the store says does not exist (S3 404 NoSuchBucket:
    deleted, failing over, or a wrong endpoint), which is no proof about any object in it.
  * None: neither (permission denied, bad request): not retried, and not proof either.

How s3fs surfaces them (s3fs.errors.translate_boto_error, s3fs.core._error_wrapper, after its
own few retries): an S3 error reply becomes a builtin exception whose `__cause__` is botocore's
ClientError, with the error code and HTTP status in `.response` (SlowDown and 503 ->
OSError(EBUSY), 500 -> OSError(EREMOTEIO), RequestTimeout -> TimeoutError, NoSuchKey and 404 ->
FileNotFoundError, an unknown code -> OSError(EIO)); a connection failure is raised as
botocore's or aiohttp's own exception (EndpointConnectionError, ReadTimeoutError,
ServerDisconnectedError, ...), which is not an OSError. The classifier therefore walks the
cause chain, reads the code and status from `.response` first (never the message text),
then the exception types and errnos.

`ReadRetry(budget_s).call(fn, what)` calls `fn` until it returns; a transient error is
retried with exponential backoff and jitter (each wait drawn from [1/2, 1] of
min(cap_s, first_s * 2^attempt)), then raised as TransientStorageError naming `what` and the
last cause (and the spec field `setting` the budget came from). Other errors pass through at
once. One ReadRetry is one budget, shared by every call made through it: a restore makes one (a
rank: for its manifest read and every piece ckpt.fetch reads; the controller: for each listing or
verification; `fresh()` copies the settings with an unspent budget) and the store's failures may
take `budget_s` seconds of it in all: the time its calls spend failing after a first transient
error, in backoff waits and in attempts that fail again, counted once where calls fail together.
An attempt that answers is reading time, not failing, however long its transfer: a long restore
under steady throttling, where every retry works, is not given up. So a restore lasts at most its
healthy reading time plus `budget_s`, however the store flaps, and the controller's wait for it
is derived from the budget (orchestrator.controller.restore_policy). With `renews` the budget is
per outage instead: a training data reader (trainer.tokens.reader) lives for days, and each
outage of its store may take `budget_s`, spent anew once no call is failing. Thread-safe; tests
inject `clock`, `sleep` and `rng`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from ckpt.errors import CorruptCheckpoint, TransientStorageError

log = logging.getLogger(__name__)

DEFAULT_READ_RETRY_S = 120.0
INTERRUPT_TICK_S = 0.5
TRANSIENT, CORRUPT = "transient", "corrupt"
_NEITHER = "neither"  # the store answered with an error that is neither (403, 400): decided, not retried

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EIO", "EBUSY", "EAGAIN", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE",
        "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN", "ENETRESET", "ESTALE", "EREMOTEIO")
    if hasattr(errno, name))
# S3 error codes that mean "ask again later" (AWS's throttling and server-side codes).
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequests", "TooManyRequestsException", "ServiceUnavailable",
    "InternalError", "RequestTimeout", "BandwidthLimitExceeded", "EC2ThrottledException"})
_CORRUPT_CODES = frozenset({"NoSuchKey", "NotFound", "InvalidRange"})
# A 404 about the store's location, not about an object in it: a bucket missing (deleted, failing
# over, a wrong region's endpoint) proves nothing about a checkpoint's bytes, and may come back.
_LOCATION_CODES = frozenset({"NoSuchBucket"})
# Connection-level exceptions of the HTTP stacks under s3fs and other object-store clients,
# matched by name so that this module needs none of them installed.
_CLIENT_LIBRARIES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http.client")
_TRANSIENT_NAMES = frozenset({
    "ConnectionError", "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError",
    "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError",
    "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError", "ServerTimeoutError",
    "ProtocolError", "IncompleteRead", "RemoteDisconnected"})

T = TypeVar("T")


def classify(err: BaseException) -> str | None:
    """"corrupt", "transient" or None for an exception from a storage read (see module doc)."""
    chain = list(_chain(err))
    if any(isinstance(e, CorruptCheckpoint) for e in chain):  # a caller's own proof (checksum, parse)
        return CORRUPT
    for e in chain:  # the store's own answer decides, when there is one
        verdict = _from_response(getattr(e, "response", None))
        if verdict is not None:
            return None if verdict == _NEITHER else verdict
    if any(isinstance(e, FileNotFoundError) for e in chain):
        return CORRUPT
    if any(_transient_type(e) for e in chain):
        return TRANSIENT
    return None


def is_transient(err: BaseException) -> bool:
    return classify(err) == TRANSIENT


def storage_failure(err: BaseException) -> bool:
    """Whether `err` is a store's failure, not a bug: OSError and ValueError (fsspec's, s3fs's
    translations), and the HTTP stack's own connection errors (botocore's, aiohttp's), which are
    not OSErrors (`is_transient`)."""
    return isinstance(err, (OSError, ValueError)) or is_transient(err)


def describe(err: BaseException) -> str:
    """`err` in one line, with the S3 error code and HTTP status of the reply behind it, if any."""
    text = f"{type(err).__name__}: {err}"
    for e in _chain(err):
        reply = _code_and_status(getattr(e, "response", None))
        if reply is not None:
            return f"{text} (S3 {reply[0]}, HTTP {reply[1]})"
    return text


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and its explicit causes (`raise ... from`, s3fs's translated errors). Not `__context__`:
    an error raised while another was being handled was not caused by it."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__


def _code_and_status(response: object) -> tuple[object, object] | None:
    """The S3 error code and HTTP status of a botocore reply (`ClientError.response`), or None."""
    if not isinstance(response, dict):
        return None
    return (response.get("Error") or {}).get("Code"), (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def _from_response(response: object) -> str | None:
    reply = _code_and_status(response)
    if reply is None:
        return None
    code, status = reply
    if code in _LOCATION_CODES:
        return TRANSIENT
    if code in _CORRUPT_CODES or status in (404, 416):
        return CORRUPT
    if code in _TRANSIENT_CODES or status == 429 or (isinstance(status, int) and status >= 500):
        return TRANSIENT
    return None if code is None and status is None else _NEITHER


def _transient_type(e: BaseException) -> bool:
    if isinstance(e, (TimeoutError, ConnectionError, TransientStorageError)):
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    return any(cls.__name__ in _TRANSIENT_NAMES and cls.__module__.split(".")[0] in _CLIENT_LIBRARIES
               for cls in type(e).__mro__)


@dataclass
class ReadRetry:
    """Retry transient read errors; the store's failures may take `budget_s` seconds of all the calls
    made through this one instance together (see module doc)."""

    budget_s: float = DEFAULT_READ_RETRY_S
    setting: str = "checkpoint.read_retry_s"  # the spec field `budget_s` came from, for the error
    # False: one budget for the instance's life (a restore). True: each failing spell gets the whole
    # budget, renewed once every call has answered (a training data reader, which lives for days).
    renews: bool = False
    # Called between a failing call's retries (and during each wait, every INTERRUPT_TICK_S): it may
    # raise to give the read up, as a rank's stale restore does (orchestrator.rank.restore_turns).
    interrupt: Callable[[], None] | None = None
    first_s: float = 0.2
    cap_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)
    # The budget spent so far: the time spans its calls spent failing (disjoint, sorted; overlapping
    # ones merged, so calls failing together count once), and how many calls are failing now.
    _spans: list[list[float]] = field(default_factory=list, init=False, repr=False, compare=False)
    _failing: int = field(default=0, init=False, repr=False, compare=False)
    _held: int = field(default=0, init=False, repr=False, compare=False)  # open `one_outage` blocks
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def fresh(self) -> ReadRetry:
        """The same settings with an unspent budget: one per restore or verification."""
        return dataclasses.replace(self)

    def backoff(self, attempt: int) -> float:
        """The wait before retry `attempt` (0-based), jittered."""
        ceiling = min(self.cap_s, self.first_s * 2.0 ** attempt)
        return ceiling * self.rng.uniform(0.5, 1.0)

    def call(self, fn: Callable[[], T], what: str) -> T:
        attempt, failing = 0, False
        try:
            while True:
                began = self.clock()
                try:
                    return fn()
                except Exception as err:
                    if classify(err) != TRANSIENT:
                        raise
                    # The first error starts the failing; a retry that fails again was failing time too.
                    spent = self._failed(None if not failing else began, first=not failing)
                    failing = True
                    left = self.budget_s - spent
                    if left <= 0:
                        raise TransientStorageError(
                            f"{what}: the store kept failing reads for {spent:.1f} s ({self.setting}="
                            f"{self.budget_s:g}): {describe(err)}") from err
                    if attempt == 0:
                        log.warning("%s: %s; retrying for up to %.0f s", what, describe(err), left)
                    waited_from = self.clock()
                    try:
                        self._wait(min(self.backoff(attempt), left))
                    finally:
                        with self._lock:
                            self._count(waited_from, self.clock())
                    attempt += 1
        finally:
            if failing:
                self._answered()

    def _wait(self, seconds: float) -> None:
        if self.interrupt is None:
            self.sleep(seconds)
            return
        while seconds > 0:
            self.interrupt()
            self.sleep(min(seconds, INTERRUPT_TICK_S))
            seconds -= INTERRUPT_TICK_S
        self.interrupt()

    def _failed(self, attempt_began: float | None, first: bool) -> float:
        """A call met a transient error (`first`: its first; `attempt_began`: when the attempt that
        failed began, None not to count it); the budget spent so far."""
        with self._lock:
            self._failing += first
            if attempt_began is not None:
                self._count(attempt_began, self.clock())
            return sum(end - start for start, end in self._spans)

    def _count(self, start: float, end: float) -> None:
        """Spend [start, end) (under the lock): merged into the spans it overlaps."""
        apart = [span for span in self._spans if span[1] < start or span[0] > end]
        touching = [span for span in self._spans if span not in apart]
        merged = [min([start, *(s for s, _ in touching)]), max([end, *(e for _, e in touching)])]
        self._spans = sorted([*apart, merged])

    @contextlib.contextmanager
    def one_outage(self) -> Iterator[None]:
        """With `renews`: the calls made inside share one budget, renewed only after the block, not
        between them (a training step reads each dataset of a mixture in turn, and its wait must stay
        within one budget, as the hang watchdog and the process group's timeout assume)."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                self._renew_if_over()

    def _answered(self) -> None:
        """A call that had failed returned or gave up; with `renews`, the outage ends with the last."""
        with self._lock:
            self._failing -= 1
            self._renew_if_over()

    def _renew_if_over(self) -> None:
        if self.renews and not self._failing and not self._held:
            self._spans = []


def data_read_retry(data) -> ReadRetry:
    """How a training data reader's remote reads are retried (trainer.tokens.reader): `data.read_retry_s`
    (a DataConfig's) per outage of the store."""
    return ReadRetry(data.read_retry_s, setting="data.read_retry_s", renews=True)
