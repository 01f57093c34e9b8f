"""The event log: a run's events as JSON lines under its checkpoint root, so its record outlives its pod.

Layout: `<checkpoint root>/events/<run>/<segment>.jsonl`. `<run>` names one run of the controller
(`20261203T062843Z-3fa9c1`: UTC start, then random; sorted by name = sorted by start), so a job
resumed by a new `undying run` adds a run beside the earlier ones. Each flush writes the events
gathered since the last one as a new segment (`00000000.jsonl`, `00000001.jsonl`, ...) with
`Storage.write_immutable`: one whole object per flush, never appended to or rewritten, which is
what object stores offer (S3 has no append), and nothing under a checkpoint's own directory is
touched. The step directories' readers and GC only look at `step-*` names, so they never see it.

Roll-ups. A flush every 10 s is 8,640 segments a day, a quarter of a million in a month-long run,
and `undying report` would read each object. So every `ROLL_UP` segments (or `ROLL_UP_BYTES` of
them, whichever comes first) the writer writes them again as one object named by the range it
covers (`00000000-00000255.jsonl`, first and last segment), from the bytes it still holds, then
deletes the segments it covers. A reader reads each roll-up and the segments no roll-up covers,
in order, so a crash between the roll-up and the deletes duplicates nothing; a segment whose own
write failed is in its roll-up all the same. A reader racing the deletes lists again.

Protocol. The controller's trackers (monitor.tracking) call `emit` per event, `flush` every few
seconds and at each commit, `close` once at the end; one background thread does the writes, so
a slow store never delays the controller's loop. A segment that cannot be written is retried
(`RETRIES`, with back-off), then logged and dropped: the log is telemetry and a job never stops
for it. `undying report` reads it back with `list_runs` and `read_run`.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time

from monitor.events import to_json_safe

log = logging.getLogger(__name__)

EVENTS_DIR = "events"
RETRIES = 3
CLOSE_TIMEOUT_S = 60.0
ROLL_UP = 256  # segments per roll-up: a month of 10 s flushes is about a thousand objects
ROLL_UP_BYTES = 16 << 20  # the segments' bytes the writer holds for the next roll-up, at most


def new_run_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


class EventLog:
    name = "event log"

    def __init__(self, storage, run: str | None = None, backoff_s: float = 1.0):
        self.storage = storage
        self.run = run or new_run_id()
        self.backoff_s = backoff_s
        self._lines: list[str] = []
        self._segments = 0
        self._held: list[bytes] = []  # the writer's: segments since its last roll-up, from `_rolled` on
        self._rolled = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="undying-event-log", daemon=True)
        self._thread.start()

    @property
    def path(self) -> str:
        return self.storage.path(EVENTS_DIR, self.run)

    @property
    def where(self) -> str:
        return f"{self.storage.url.rstrip('/')}/{EVENTS_DIR}/{self.run}"

    def emit(self, event: dict) -> None:
        self._lines.append(json.dumps(to_json_safe(event), allow_nan=False, separators=(",", ":")))

    def flush(self) -> None:
        """Hand the events gathered since the last flush to the writer thread as one segment."""
        if not self._lines:
            return
        data = ("\n".join(self._lines) + "\n").encode()
        self._lines = []
        self._queue.put((self._segments, data))
        self._segments += 1

    def close(self) -> None:
        """Flush, then wait (at most `CLOSE_TIMEOUT_S`) for every segment to be written."""
        self.flush()
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("event log: segments still unwritten after %.0f s; %s may lack the run's end",
                        CLOSE_TIMEOUT_S, self.path)

    def _segment_path(self, first: int, last: int | None = None) -> str:
        name = f"{first:08d}" if last is None else f"{first:08d}-{last:08d}"
        return self.storage.path(EVENTS_DIR, self.run, f"{name}.jsonl")

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            index, data = item
            self._write(self._segment_path(index), data)
            self._held.append(data)
            if len(self._held) >= ROLL_UP or sum(map(len, self._held)) >= ROLL_UP_BYTES:
                self._roll_up()

    def _write(self, path: str, data: bytes) -> bool:
        for attempt in range(RETRIES + 1):
            try:
                self.storage.write_immutable(path, data)
                return True
            except Exception as err:
                if attempt == RETRIES:
                    log.warning("event log: could not write %s (%s); its %d events are lost",
                                path, err, data.count(b"\n"))
                else:
                    time.sleep(self.backoff_s * 2**attempt)
        return False

    def _roll_up(self) -> None:
        """Write the held segments as one object, then delete them (see the module doc)."""
        first, last = self._rolled, self._rolled + len(self._held) - 1
        data, self._held, self._rolled = b"".join(self._held), [], last + 1
        if not self._write(self._segment_path(first, last), data):
            return  # the segments stay as they are
        for index in range(first, last + 1):
            try:
                self.storage.remove(self._segment_path(index))
            except Exception as err:  # left behind: readers skip what a roll-up covers
                log.debug("event log: segment %d not deleted after its roll-up (%s)", index, err)


def list_runs(storage) -> list[str]:
    """The runs logged under this checkpoint root, oldest first."""
    return storage.listdir(storage.path(EVENTS_DIR))


def read_run(storage, run: str) -> list[dict]:
    """The events of `run` in the order they were sent. A line that does not parse (a store that
    damaged an object) is skipped with a warning: the rest still rebuilds a report."""
    lists = 3
    while True:
        try:
            return _read_objects(storage, run)
        except FileNotFoundError:  # the writer rolled up segments this listing named: list again
            lists -= 1
            if not lists:
                raise


def _read_objects(storage, run: str) -> list[dict]:
    folder = storage.path(EVENTS_DIR, run)
    objects = [r for r in map(_segment_range, storage.listdir(folder)) if r is not None]
    covered = {i for first, last, rolled, _ in objects if rolled for i in range(first, last + 1)}
    events = []
    for _, _, _, name in sorted(r for r in objects if r[2] or r[0] not in covered):
        for n, line in enumerate(storage.read(f"{folder}/{name}").decode("utf-8", "replace").splitlines()):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as err:
                log.warning("event log: %s/%s line %d does not parse (%s); skipped", folder, name, n + 1, err)
    return events


def _segment_range(name: str) -> tuple[int, int, bool, str] | None:
    """(first, last, rolled, name) of a segment (`00000007.jsonl`: 7, 7, False) or a roll-up
    (`00000000-00000255.jsonl`: 0, 255, True); None for any other name."""
    if not name.endswith(".jsonl"):
        return None
    first, dash, last = name[: -len(".jsonl")].partition("-")
    if not first.isdigit() or (dash and not last.isdigit()):
        return None
    return int(first), int(last or first), bool(dash), name
