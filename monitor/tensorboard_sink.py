"""`monitor.tensorboard`: the run's events as TensorBoard scalars, one point per step for the loss.

Tags (x axis: the global step), from `monitor.events.Scalars`:

    train/loss, train/tokens_per_s, train/step_s, train/mfu, train/grad_norm   every step
    eval/loss                                                                every validation
    goodput/ratio, goodput/<bucket>_s                                        every goodput sample
    checkpoint/bytes, checkpoint/blocking_s, checkpoint/total_s              every commit
    world/size, world/dp                                                     every layout
    recovery/failures (count); recovery/detected_after_s, recovered_after_s, restore_s,
    lost_work_s, first_step_after_s                                          per failure, once training again

After a rollback the steps that are computed again are written again, so a curve shows both
executions (TensorBoard draws them in the order they were written).

Where the files go. A local directory (or `file://`) is written by torch's `SummaryWriter`
directly. Any other URL (`s3://...`) is written to a local staging directory and each event
file is uploaded whole through `ckpt.storage.Storage` (the checkpoint's storage options, so the
same credentials and endpoint) at every flush, by one background thread (a slow store never
delays the controller), and at close, which waits for it: TensorBoard's own S3 writer reads
none of our storage options and rewrites the object on every flush anyway, and S3 has no append.
Each upload replaces the whole object atomically, so a reader sees a shorter file, never a torn one.
A long job's event file grows by a few hundred bytes a step, gigabytes in a million steps, which
each flush would upload again: so past `ROLL_BYTES` the file is closed and a new one started
(TensorBoard reads every event file of a directory as one run), the closed one uploaded a last
time and its staged copy deleted, and each flush uploads only the open file.
Called from the controller thread only (monitor.tracking).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

from monitor.events import Scalars

log = logging.getLogger(__name__)
ROLL_BYTES = 8 << 20  # a staged event file past this is closed and a new one started


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, url: str, storage_options: dict | None = None):
        self.where = url
        protocol, path = fsspec.core.split_protocol(url)
        self.remote = None
        self._uploads: ThreadPoolExecutor | None = None
        if protocol in (None, "file", "local"):
            local = path
        else:
            from ckpt.storage import Storage

            self.remote = Storage(url, storage_options or {})
            local = tempfile.mkdtemp(prefix="undying-tensorboard-")
            self._uploads = ThreadPoolExecutor(1, thread_name_prefix="undying-tensorboard-upload")
        self.local_dir = Path(local)
        self._closed: set[str] = set()  # staged files the writer no longer writes: uploaded once more, deleted
        self.writer = self._new_writer()
        self.scalars = Scalars()

    def _new_writer(self):
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs: the writer's own thread writes at least this often; monitor.tracking flushes too
        return SummaryWriter(log_dir=str(self.local_dir), flush_secs=30)

    def emit(self, event: dict) -> None:
        step, row = self.scalars.row(event)
        for tag, value in row.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()
        if self._uploads is not None:
            if self._staged_bytes() >= ROLL_BYTES:
                self._roll()
            self._uploads.submit(self._upload).add_done_callback(_log_failure)

    def _staged_bytes(self) -> int:
        """The open file's bytes (the upload thread may delete a closed one meanwhile)."""
        total = 0
        for name in os.listdir(self.local_dir):
            if name not in self._closed:
                with contextlib.suppress(FileNotFoundError):
                    total += (self.local_dir / name).stat().st_size
        return total

    def _roll(self) -> None:
        """Close the open event file and start another; marked closed only once closed, so the
        upload thread never deletes a file the writer may still add to."""
        staged = set(os.listdir(self.local_dir))
        self.writer.close()
        self.writer = self._new_writer()
        self._closed |= staged

    def close(self) -> None:
        self.writer.close()
        if self._uploads is not None:
            self._uploads.shutdown(wait=True)  # the uploads queued by earlier flushes finish first
            self._upload()  # the files as closed; raises, for monitor.tracking to log, if it fails
            shutil.rmtree(self.local_dir, ignore_errors=True)

    def _upload(self) -> None:
        for name in sorted(os.listdir(self.local_dir)):
            closed = name in self._closed  # read before the upload: one closed after is uploaded again later
            with self.remote.atomic_writer(self.remote.path(name)) as out:
                out.write((self.local_dir / name).read_bytes())
            if closed:  # its last upload: the staging directory keeps only the open file
                (self.local_dir / name).unlink()
                self._closed.discard(name)


def _log_failure(future) -> None:
    if future.exception() is not None:
        log.warning("tensorboard: upload failed (%s); the next flush tries again", future.exception())
