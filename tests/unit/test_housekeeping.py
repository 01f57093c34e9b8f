"""Store work off the controller's thread (ckpt.housekeeping): a newer submission replaces queued work,
`settle` waits with a bound, a failing work is logged and the thread goes on; and the committer's
retention and GC run there, so a slow store never holds the commit (ckpt.commit)."""

from __future__ import annotations

import logging
import threading

import torch

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.housekeeping import Housekeeper
from ckpt.storage import Storage
from tests._checkpoints import feed, shard_receipts


def _blocked(keeper: Housekeeper, ran: list) -> threading.Event:
    """Occupy `keeper`'s thread with work that waits for the returned event."""
    release, started = threading.Event(), threading.Event()
    keeper.submit(lambda: (started.set(), release.wait(10), ran.append("first")))
    assert started.wait(5)
    return release


def test_a_newer_submission_replaces_work_not_yet_started():
    keeper, ran = Housekeeper("test-keeper"), []
    release = _blocked(keeper, ran)
    for name in ("second", "third"):
        keeper.submit(lambda name=name: ran.append(name))
    assert keeper.busy and not keeper.settle(0.05)  # the first still runs, the third is queued
    release.set()
    assert keeper.settle(5) and not keeper.busy
    assert ran == ["first", "third"]
    assert keeper._thread.daemon  # a store call hung on a dead endpoint never holds the process's exit


def test_discard_drops_the_queued_work_only():
    keeper, ran = Housekeeper("test-keeper"), []
    release = _blocked(keeper, ran)
    keeper.submit(lambda: ran.append("queued"))
    keeper.discard()
    release.set()
    assert keeper.settle(5) and ran == ["first"]


def test_close_settles_then_ends_the_thread_and_a_later_submission_starts_another():
    keeper, ran = Housekeeper("test-keeper"), []
    keeper.submit(lambda: ran.append("one"))
    thread = keeper._thread
    assert keeper.close(5) and ran == ["one"]
    thread.join(5)
    assert not thread.is_alive() and keeper._thread is None
    keeper.submit(lambda: ran.append("two"))
    assert keeper.settle(5) and ran == ["one", "two"]


def test_a_failing_work_is_logged_and_the_next_one_runs(caplog):
    keeper, ran = Housekeeper("test-keeper"), []
    keeper.submit(lambda: 1 / 0)
    assert keeper.settle(5)
    keeper.submit(lambda: ran.append("next"))
    assert keeper.settle(5) and ran == ["next"]
    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "background store work failed" in failed[0].getMessage() and failed[0].exc_info[0] is ZeroDivisionError


class _SlowListing(Storage):
    """A store whose listings of the job's root (retention's, GC's) wait for `release` (a throttling
    object store, a hung request); the commit's own listing of its step directory does not."""

    def __init__(self, url: str):
        super().__init__(url)
        self.release, self.listing = threading.Event(), threading.Event()
        self.slow = False

    def listdir(self, path: str) -> list[str]:
        if self.slow and path.rstrip("/") == self.root.rstrip("/"):
            self.listing.set()
            assert self.release.wait(10)
        return super().listdir(path)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((4, 4), float(step)), "model/b": torch.arange(4.0) + step}


def test_retention_after_a_commit_runs_beside_the_controller_not_in_its_way(tmp_path):
    storage = _SlowListing(f"file://{tmp_path}/ckpt/job")
    catalog = Catalog(storage)
    committer = Committer(catalog, "j", "h", keep=1, housekeeper=Housekeeper("test-retention"))
    assert feed(committer, shard_receipts(catalog, 10, _state(10))).step == 10
    assert committer.settle(5)
    storage.slow = True  # from here on every listing hangs until released
    commit = feed(committer, shard_receipts(catalog, 20, _state(20)))
    # The commit is back (its manifest durable) while its retention pass waits on the store.
    assert commit.step == 20 and committer.latest == 20
    assert storage.listing.wait(5) and not committer.settle(0.05)
    storage.slow = False
    storage.release.set()
    assert committer.settle(5)
    assert catalog.committed_steps() == [20]  # keep=1: step 10 deleted by the background pass


def test_a_new_generation_drops_a_pass_queued_for_the_last_one(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    keeper, ran = Housekeeper("test-retention"), []
    committer = Committer(catalog, "j", "h", keep=1, housekeeper=keeper)
    release = _blocked(keeper, ran)
    feed(committer, shard_receipts(catalog, 10, _state(10)))
    feed(committer, shard_receipts(catalog, 20, _state(20)))  # its pass is queued behind the blocked work
    committer.reset(20)  # a recovery: the queued pass planned against the last generation's saves is dropped
    release.set()
    assert committer.settle(5) and ran == ["first"]
    assert catalog.committed_steps() == [10, 20]  # nothing deleted: the next commit's pass does it


def test_a_pass_running_when_a_new_generation_begins_deletes_nothing_more(tmp_path):
    # Its GC would take the new generation's saves below the commit it followed for orphans (a
    # restore that fell back to an older step saves there): it stops at its next deletion.
    storage = _SlowListing(f"file://{tmp_path}/ckpt/job")
    catalog = Catalog(storage)
    committer = Committer(catalog, "j", "h", keep=1, housekeeper=Housekeeper("test-retention"))
    feed(committer, shard_receipts(catalog, 10, _state(10)))
    assert committer.settle(5)
    storage.slow = True
    feed(committer, shard_receipts(catalog, 20, _state(20)))  # its pass would delete step 10 (keep=1)
    assert storage.listing.wait(5)  # the pass is listing the root
    committer.reset(10)  # a recovery restored step 10: a new generation
    storage.slow = False
    storage.release.set()
    assert committer.settle(5)
    assert catalog.committed_steps() == [10, 20]  # stopped before its first deletion
