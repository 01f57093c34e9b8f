"""Which storage calls a storage fault hits, and what it does to them: the decision, no I/O.

A `StorageFaultPlan` holds the storage faults of a job (FaultSpecs or their dicts, as the
controller stores them; other kinds are ignored) and answers `judge(op, path)` once per
storage call with a `Verdict`. chaos.storage_faults asks it before every call it wraps.

Semantics of one fault (fields of chaos.config.FaultSpec):
* `op` (write | read | list | delete; default all) and `path` (an fnmatch glob on the
  path as the storage layer passes it, e.g. `*/manifest.json`, `*/shard-*`; `*` also
  matches `/`) select the calls it looks at; `at_step` narrows them to that checkpoint's
  directory (`step-<9 digits>`). `at_seconds` and `duration_s` make it active in that
  window of seconds after `started` (the job's start on `clock`; default: when the plan
  was built), from the start and for ever when not given; `duration_s` without `at_seconds`
  opens the window at the first call the fault matches, in each plan (a rank builds one per
  restore, so every restore of that rank meets "its reads fail for 10 s").
  `at_point` is not evaluated here: the caller installs the plan when the point is reached.
* Of the matching calls, which fire: `nth: k` the k-th (with `repeat`, every k-th);
  `probability: p` each with chance p from a generator seeded with (seed, fault index)
  (without `repeat`, at most once); neither: the first one (with `repeat`, every one), and
  for `storage_latency` or a fault with `duration_s` every one in its window.
* What firing does: `storage_latency` delays the call by `delay_s`; `storage_error` fails
  it `before` it runs (default; nothing happens) or `after` it succeeded (the effect
  landed but the caller sees an error, as when a reply is lost); `storage_throttle` refuses
  it before it runs with S3's 503 SlowDown, raised as s3fs raises it (OSError EBUSY whose
  cause is botocore's ClientError with code SlowDown and status 503), so readers classify it
  as the real thing (ckpt.storage_errors); `torn_write` lets only `keep_fraction` (default
  0.5) of the bytes land at the path, then fails.
Every call counts towards `nth` of every fault it matches, whichever fault fires.

Thread-safe: a rank's background shard writer and its training thread may share a plan.
"""

from __future__ import annotations

import errno
import fnmatch
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from chaos.config import STORAGE_KINDS, ArmedFault, FaultSpec, as_armed

OPS = ("write", "read", "list", "delete")
DEFAULT_KEEP_FRACTION = 0.5


class InjectedStorageError(OSError):
    """The I/O error a storage fault raises (errno EIO, like a failing disk or a 5xx reply)."""


class InjectedThrottle(InjectedStorageError):
    """The error a storage_throttle fault raises: s3fs's OSError(EBUSY) for S3's 503 SlowDown."""


_S3_OPERATIONS = {"read": "GetObject", "write": "PutObject", "list": "ListObjectsV2", "delete": "DeleteObject"}


def slow_down(op: str, message: str) -> InjectedThrottle:
    """A 503 SlowDown reply to a storage call `op`, as s3fs raises it: OSError(EBUSY) whose `__cause__`
    is botocore's ClientError (a stand-in of the same shape where botocore is not installed)."""
    response = {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                "ResponseMetadata": {"HTTPStatusCode": 503}}
    try:
        from botocore.exceptions import ClientError
    except ImportError:  # file:// only installs: the same attributes s3fs's callers would see
        cause: Exception = RuntimeError(f"An error occurred (SlowDown) when calling the {_S3_OPERATIONS[op]} "
                                        "operation: Please reduce your request rate.")
        cause.response = response  # type: ignore[attr-defined]
    else:
        cause = ClientError(response, _S3_OPERATIONS[op])
    err = InjectedThrottle(errno.EBUSY, message)
    err.__cause__ = cause
    return err


@dataclass(frozen=True)
class Verdict:
    """What to do to one storage call: delay it, then fail before, tear, fail after, or let it be."""

    delay_s: float = 0.0
    fail: str | None = None  # "before" | "after"
    keep_fraction: float | None = None  # set for a torn write
    reason: str = ""  # which fault fired, for the error message
    throttle: bool = False  # fail with S3's 503 SlowDown instead of EIO

    @property
    def clean(self) -> bool:
        return self.delay_s == 0.0 and self.fail is None and self.keep_fraction is None

    def error(self, op: str, path: str, detail: str = "") -> InjectedStorageError:
        message = f"injected {self.reason} on {op} of {path}{detail}"
        return slow_down(op, message) if self.throttle else InjectedStorageError(errno.EIO, message)


@dataclass
class _Rule:
    index: int
    fault: ArmedFault
    ops: frozenset[str]
    glob: str | None
    step_part: re.Pattern | None
    window: tuple[float, float] | None  # None: opens at the first matching call
    rng: random.Random
    matched: int = 0
    fired: int = 0

    @classmethod
    def build(cls, index: int, fault: ArmedFault, seed: int) -> _Rule:
        kind, op, step = fault.kind, fault.op, fault.at_step
        ops = frozenset({"write"} if kind == "torn_write" else ({op} if op else OPS))
        start = float(fault.at_seconds or 0.0)
        duration = fault.duration_s
        end = start + float(duration) if duration is not None else float("inf")
        window = None if duration is not None and fault.at_seconds is None else (start, end)
        step_part = re.compile(rf"(^|/)step-{int(step):09d}(/|$)") if step is not None else None
        # Seeded by the fault's id, not its place in this process's list: a rank's and the controller's
        # lists hold different faults, and a rank's shrinks as one-shot faults fire.
        return cls(index, fault, ops, fault.path, step_part, window,
                   random.Random(f"undying.storage-faults:{seed}:{fault.id}"))

    def matches(self, op: str, path: str, elapsed: float) -> bool:
        if not (op in self.ops and (self.glob is None or fnmatch.fnmatchcase(path, self.glob))
                and (self.step_part is None or self.step_part.search(path) is not None)):
            return False
        if self.window is None:  # duration_s alone: the window opens now
            self.window = (elapsed, elapsed + float(self.fault.duration_s))
        return self.window[0] <= elapsed < self.window[1]

    def triggers(self) -> bool:
        """Count this matching call; whether the fault fires on it."""
        self.matched += 1
        nth, p, repeat = self.fault.nth, self.fault.probability, bool(self.fault.repeat)
        if nth is not None:
            return self.matched % nth == 0 if repeat else self.matched == nth
        if p is not None:
            # Drawn on every matching call, so the sequence does not depend on earlier outcomes.
            hit = self.rng.random() < p
            return hit and (repeat or self.fired == 0)
        return repeat or self.fault.kind == "storage_latency" or self.fault.duration_s is not None or self.matched == 1


class StorageFaultPlan:
    """The storage faults of one process, with their call counters (see module doc).

    `notify(event)` is called for each error or torn write that fires and for the first
    delay of each latency fault, with {"type": "fault", "fault_id", "kind", "op", "path",
    "mode", "time"}, so the controller can time the fault as it does rank faults.
    A plan built in another process than the job's clock (a rank) passes
    `clock=time.time, started=<job start, epoch seconds>` so `at_seconds` means job seconds.
    """

    def __init__(
        self, faults: Iterable[FaultSpec | Mapping], *, seed: int = 0,
        notify: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic,
        started: float | None = None, sleep: Callable[[float], None] = time.sleep,
        gate: Callable[[ArmedFault], bool] | None = None,
    ):
        armed = [as_armed(f, i) for i, f in enumerate(faults)]
        # gate(fault): whether the fault may act yet (a rank's data fault from its step on); until it
        # may, its calls are not counted and a window that opens at its first call stays closed.
        self._gate = gate
        self.rules = [_Rule.build(i, f, seed) for i, f in enumerate(armed) if f.kind in STORAGE_KINDS]
        self.notify = notify
        self.sleep = sleep
        self.fired: list[dict] = []  # every event also passed to notify, for reports and tests
        self._clock = clock
        self._started = clock() if started is None else float(started)
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.rules)

    def judge(self, op: str, path: str) -> Verdict:
        """The verdict for one call of kind `op` (write | read | list | delete) on `path`."""
        if op not in OPS:
            raise ValueError(f"unknown storage operation {op!r}; expected one of {OPS}")
        delay, fail, keep, reason, events, throttle = 0.0, None, None, "", [], False
        with self._lock:
            elapsed = self._clock() - self._started
            for rule in self.rules:
                if self._gate is not None and not self._gate(rule.fault):
                    continue
                if not rule.matches(op, path, elapsed) or not rule.triggers():
                    continue
                kind = rule.fault.kind
                if kind == "storage_latency":
                    delay += float(rule.fault.delay_s)
                    if rule.fired == 0:
                        events.append(self._event(rule, op, path, "latency"))
                elif fail is None and keep is None:
                    if kind == "torn_write":
                        keep = rule.fault.keep_fraction
                        keep = DEFAULT_KEEP_FRACTION if keep is None else float(keep)
                    else:
                        fail = rule.fault.when or "before"
                        throttle = kind == "storage_throttle"
                    reason = f"{kind} (fault {rule.fault.id})"
                    events.append(self._event(rule, op, path, "torn" if keep is not None else fail))
                else:
                    continue  # an earlier fault already decides this call's outcome
                rule.fired += 1
            self.fired.extend(events)
        for event in events:
            if self.notify is not None:
                self.notify(event)
        return Verdict(delay, fail, keep, reason, throttle)

    def _event(self, rule: _Rule, op: str, path: str, mode: str) -> dict:
        return {"type": "fault", "fault_id": rule.fault.id, "kind": rule.fault.kind,
                "op": op, "path": path, "mode": mode, "time": time.time()}


