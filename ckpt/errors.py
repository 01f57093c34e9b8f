"""Typed checkpoint errors: what a caller may branch on.

* `CorruptCheckpoint`: a committed checkpoint cannot be read back intact (a missing or
  truncated shard, a block whose CRC32 does not match, chunks that do not cover a tensor).
  Retriable with another checkpoint: the controller marks the step bad and restores the
  previous committed one, loudly.
* `IncompleteCheckpoint`: the shard receipts of a save do not tile every logical tensor
  exactly (a gap, an overlap, a slice written twice, a dtype/shape disagreement). Raised
  before the manifest is created, so such a state is never committed.
* `UnsupportedManifest`: the manifest was written in a schema this code does not read.
  Fatal for that checkpoint and for its older siblings alike, so it is not a
  `CorruptCheckpoint` (falling back would silently restart from an older state or scratch).
"""

from __future__ import annotations


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint cannot be read back intact (missing shard, bad checksum)."""


class IncompleteCheckpoint(ValueError):
    """The chunks of a save do not cover every logical tensor exactly once."""


class UnsupportedManifest(RuntimeError):
    """A manifest's `schema_version` is not the one this code reads.

    Deliberately not a ValueError: pydantic wraps ValueErrors raised in validators into a
    generic ValidationError, and this message must reach the user as written.
    """
