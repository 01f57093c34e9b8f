"""Typed checkpoint errors: what a caller may branch on.

* `CorruptCheckpoint`: a committed checkpoint cannot be read back intact (a missing or
  truncated shard, a block whose CRC32 does not match, chunks that do not cover a tensor).
  Retriable with another checkpoint: the controller marks the step bad and restores the
  previous committed one, loudly.
* `IncompleteCheckpoint`: the shard receipts of a save do not tile every logical tensor
  exactly (a gap, an overlap, a slice written twice, a dtype/shape disagreement). Raised
  before the manifest is created, so such a state is never committed.
* `TransientStorageError`: the store did not answer a read (a timeout, a reset connection, an
  HTTP 5xx, S3 throttling) for longer than the read retry budget (`checkpoint.read_retry_s`,
  ckpt.storage_errors.ReadRetry). It proves nothing about the checkpoint's bytes: the
  controller never quarantines or falls back from a checkpoint for it; the job fails naming
  the checkpoint and the cause, and deletes nothing.
* `UnsupportedManifest`: the manifest was written in a schema this code does not read.
  Fatal for that checkpoint and for its older siblings alike, so it is not a
  `CorruptCheckpoint` (falling back would silently restart from an older state or scratch).
* `SnapshotUnavailable`: a memory snapshot's shard is held by no process that answers (its
  holders died since the controller chose it). No proof about any stored bytes: the controller
  restores from the storage level instead.
"""

from __future__ import annotations


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint cannot be read back intact (missing shard, bad checksum).

    `location`: (file, start, end), the bytes of the step's shard file whose read proved it, when
    a read did (ckpt.fetch), or (MANIFEST_NAME, 0, 0) when its manifest is missing or does not parse
    (ckpt.reader.read_manifest); None for proof found elsewhere (the coverage). An attribute, so it
    survives pickling (Ray hands a rank's error to the controller with it)."""

    location: tuple[str, int, int] | None = None


def location_of(err: BaseException) -> tuple[str, int, int] | None:
    """The `location` of a CorruptCheckpoint as raised, or as Ray hands it on (a RayTaskError that is
    an instance of its cause, the original on `.cause`)."""
    return getattr(err, "location", None) or getattr(getattr(err, "cause", None), "location", None)


def corrupt_at(message: str, file: str, start: int, end: int) -> CorruptCheckpoint:
    err = CorruptCheckpoint(message)
    err.location = (file, start, end)
    return err


class TransientStorageError(OSError):
    """The store kept failing a read with errors that prove nothing about the bytes (timeouts,
    connection errors, 5xx, throttling) for the whole retry budget. An OSError, so tools that fold
    storage errors into one line keep doing so."""


class IncompleteCheckpoint(ValueError):
    """The chunks of a save do not cover every logical tensor exactly once."""


class UnsupportedManifest(RuntimeError):
    """A manifest's `schema_version` is not the one this code reads.

    Deliberately not a ValueError: pydantic wraps ValueErrors raised in validators into a
    generic ValidationError, and this message must reach the user as written.
    """


class SnapshotUnavailable(RuntimeError):
    """No live holder of a memory snapshot's shard answered: restore from storage instead."""


class ReadAbandoned(Exception):
    """Raised by a reader's own check (a restore gone stale) inside a read: the reader gave up, the
    source did not fail, so it is never taken for a failed holder or store and tried elsewhere."""
