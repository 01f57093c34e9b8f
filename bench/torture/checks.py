"""What the save-torture bench checks after each kill, with the real catalog, verifier and loader.

Called once per kill, on the checkpoint root the killed writer used (tests/_torn_writer.py:
step 10 saved and committed, then step 20 killed somewhere). Everything is counted, never
asserted, so the bench prints the whole table even when something is wrong; `Tally.bad` is
what must stay 0:
  * every step the catalog lists as committed verifies (`verify_checkpoint`: every block's
    CRC32, every tensor covered) and loads (`load_checkpoint`) bit-equal to what was saved;
  * an uncommitted step does not load, and `newest_loadable` names the newest committed step;
  * the commit is the manifest create: a create that returned is committed, a step whose
    create never began is not;
  * no shard object is visible with bytes other than its final ones (a torn write).
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch

from ckpt.catalog import Catalog
from ckpt.errors import CorruptCheckpoint, IncompleteCheckpoint
from ckpt.manifest import step_dir
from ckpt.reader import load_checkpoint, newest_loadable, verify_checkpoint
from tests._torn_kills import NEW, Outcome, digest, settled_steps, shard_objects, stage_of
from tests._torn_writer import logical_state

# Where a kill landed, in save order (the columns of the table).
WHERE = ("staging", "shard write", "commit, before the create", "manifest create", "after commit")
_STAGE_WORDS = {"before_shard": "staging", "mid_shard": "shard write", "before_manifest": "commit, before the create"}


@dataclass
class Tally:
    points: int = 0
    where: collections.Counter = field(default_factory=collections.Counter)
    new_committed: int = 0  # kills after which step 20 was committed (its manifest create had landed)
    checked: int = 0  # committed checkpoints verified and loaded after the kills
    intact: int = 0  # of those, the ones that loaded bit-equal to what was saved
    bad_loadable: int = 0  # a checkpoint that loads but is not what was saved, or is not committed
    committed_broken: int = 0  # a committed checkpoint that does not verify or load
    commit_lost: int = 0  # the manifest create returned, yet the step is not committed
    torn_visible: int = 0  # a shard object visible with bytes it was never meant to have
    problems: list[str] = field(default_factory=list)

    @property
    def bad(self) -> int:
        return self.bad_loadable + self.committed_broken + self.commit_lost + self.torn_visible


def where(events: list[str], committed: bool) -> str:
    """Which part of the step-20 save the kill landed in, from the events the writer reported."""
    new = step_dir(NEW)
    if f"manifest_end {new}" in events:
        return "after commit"
    if f"manifest_begin {new}" in events:
        return "manifest create"  # the create may or may not have landed before the kill
    return _STAGE_WORDS[stage_of(events, committed=False)]


@functools.lru_cache(maxsize=2)
def _saved(step: int) -> dict[str, torch.Tensor]:
    return logical_state(step)


def _equal(tensors: dict[str, torch.Tensor], step: int) -> bool:
    want = _saved(step)
    return set(tensors) == set(want) and all(
        tensors[n].dtype == t.dtype and torch.equal(tensors[n], t) for n, t in want.items())


def _check_committed(catalog: Catalog, step: int, tally: Tally, label: str) -> None:
    tally.checked += 1
    try:
        verify_checkpoint(catalog, step)
        tensors, manifest = load_checkpoint(catalog, step)
    except (CorruptCheckpoint, IncompleteCheckpoint, OSError, ValueError) as err:
        tally.committed_broken += 1
        tally.problems.append(f"{label}: committed step {step} does not load: {type(err).__name__}: {err}")
        return
    if manifest.step == step and _equal(tensors, step):
        tally.intact += 1
    else:
        tally.bad_loadable += 1
        tally.problems.append(f"{label}: committed step {step} loads, but not what was saved")


def _check_uncommitted(catalog: Catalog, tally: Tally, label: str) -> None:
    try:
        load_checkpoint(catalog, NEW)
    except (CorruptCheckpoint, IncompleteCheckpoint, OSError, ValueError):
        return  # refused, as it must be
    tally.bad_loadable += 1
    tally.problems.append(f"{label}: step {NEW} loads although it was never committed")


def check_after_kill(catalog: Catalog, out: Outcome, shards: dict[str, str], tally: Tally, label: str) -> None:
    """Count what the kill described by `out` left in `catalog` (see module doc)."""
    committed = settled_steps(catalog)
    new = NEW in committed
    tally.points += 1
    tally.where[where(out.events, new)] += 1
    tally.new_committed += new
    if f"manifest_end {step_dir(NEW)}" in out.events and not new:
        tally.commit_lost += 1
        tally.problems.append(f"{label}: the manifest create of step {NEW} returned, but it is not committed")
    if new and f"manifest_begin {step_dir(NEW)}" not in out.events:
        tally.bad_loadable += 1
        tally.problems.append(f"{label}: step {NEW} is committed although its manifest create never began")
    for step in committed:
        _check_committed(catalog, step, tally, label)
    if not new:
        _check_uncommitted(catalog, tally, label)
    newest = newest_loadable(catalog)
    if newest != (committed[-1] if committed else None):
        tally.bad_loadable += 1
        tally.problems.append(f"{label}: newest_loadable says {newest}, the committed steps are {committed}")
    for name in shard_objects(catalog, NEW):
        if digest(catalog, NEW, name) != shards.get(name):
            tally.torn_visible += 1
            tally.problems.append(f"{label}: {name} is visible with bytes it was never meant to have")
