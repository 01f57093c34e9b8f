"""The event log: a run's events as JSON lines under its checkpoint root, so its record outlives its pod.

Layout: `<checkpoint root>/events/<run>/<segment>.jsonl`. `<run>` names one run of the controller
(`20261203T062843Z-3fa9c1`: UTC start, then random; sorted by name = sorted by start), so a job
resumed by a new `undying run` adds a run beside the earlier ones. Each flush writes the events
gathered since the last one as a new segment (`00000000.jsonl`, `00000001.jsonl`, ...) with
`Storage.write_immutable`: one whole object per flush, never appended to or rewritten, which is
what object stores offer (S3 has no append), and nothing under a checkpoint's own directory is
touched. The step directories' readers and GC only look at `step-*` names, so they never see it.

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
        self._queue.put((self.storage.path(EVENTS_DIR, self.run, f"{self._segments:08d}.jsonl"), data))
        self._segments += 1

    def close(self) -> None:
        """Flush, then wait (at most `CLOSE_TIMEOUT_S`) for every segment to be written."""
        self.flush()
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("event log: segments still unwritten after %.0f s; %s may lack the run's end",
                        CLOSE_TIMEOUT_S, self.path)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            path, data = item
            for attempt in range(RETRIES + 1):
                try:
                    self.storage.write_immutable(path, data)
                    break
                except Exception as err:
                    if attempt == RETRIES:
                        log.warning("event log: could not write %s (%s); its %d events are lost",
                                    path, err, data.count(b"\n"))
                    else:
                        time.sleep(self.backoff_s * 2**attempt)


def list_runs(storage) -> list[str]:
    """The runs logged under this checkpoint root, oldest first."""
    return storage.listdir(storage.path(EVENTS_DIR))


def read_run(storage, run: str) -> list[dict]:
    """The events of `run` in the order they were sent. A line that does not parse (a store that
    damaged an object) is skipped with a warning: the rest still rebuilds a report."""
    events = []
    folder = storage.path(EVENTS_DIR, run)
    for name in storage.listdir(folder):
        if not name.endswith(".jsonl"):
            continue
        for n, line in enumerate(storage.read(f"{folder}/{name}").decode("utf-8", "replace").splitlines()):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as err:
                log.warning("event log: %s/%s line %d does not parse (%s); skipped", folder, name, n + 1, err)
    return events
