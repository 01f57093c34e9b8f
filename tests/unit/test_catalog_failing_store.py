"""The catalog and the committer under a store that fails: a stat that fails is an error, never an
absent manifest (fsspec's `exists` says False for any exception), so no committed step is skipped
at restore or deleted as garbage; a torn manifest found when a commit is retried is withdrawn under
its own name and counts as no quarantined checkpoint."""

from __future__ import annotations

import errno
import random

import pytest

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.manifest import MANIFEST_NAME, step_dir
from ckpt.shards import owned_by, write_shard
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry
from orchestrator.controller.restore_policy import RestorePolicy
from tests._checkpoints import make_state, save_checkpoint


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    """Committed steps 10, 20, 30 on file://."""
    catalog = Catalog(Storage(f"file://{tmp_path}/job"))
    for step in (10, 20, 30):
        save_checkpoint(catalog, step, make_state(step), world=2)
    return catalog


def _stat_fails(catalog: Catalog, step: int, times: int, error=None) -> list[str]:
    """Make the local file system's `info` of step `step`'s manifest raise EIO `times` times (as a
    flaky disk or NFS mount does); returns the log of failed calls. The real local `exists` calls
    `info` and swallows every exception. `error`: what to raise instead of EIO."""
    failed: list[str] = []
    fs = catalog.storage.fs
    real = fs.info
    target = catalog.storage.path(step_dir(step), MANIFEST_NAME)

    def info(path, **kwargs):
        if str(path).endswith(target) and len(failed) < times:
            failed.append(str(path))
            raise error or OSError(errno.EIO, "Input/output error")
        return real(path, **kwargs)

    fs.info = info
    return failed


def _files(catalog: Catalog) -> list[str]:
    return sorted(catalog.storage.fs.find(catalog.storage.root))


def test_a_failing_stat_of_a_committed_manifest_raises_and_gc_deletes_nothing(catalog):
    before = _files(catalog)
    _stat_fails(catalog, 20, times=100)
    assert catalog.storage.exists(catalog.manifest_path(10))
    with pytest.raises(OSError, match="Input/output error"):
        catalog.committed_steps()  # not [10, 30]: step 20 is not known to be absent
    with pytest.raises(OSError):
        catalog.collect_garbage()  # step 20 would have looked like an unfinished save older than 30
    with pytest.raises(OSError):
        catalog.gc_plan(keep=3)
    assert _files(catalog) == before


def test_the_restore_retries_a_failing_stat_instead_of_restoring_an_older_step(catalog):
    failed = _stat_fails(catalog, 30, times=2)
    policy = RestorePolicy(catalog, read_retry_s=30.0)
    policy.retry = ReadRetry(30.0, sleep=lambda s: None, rng=random.Random(0))
    assert policy.restore_point() == 30
    assert len(failed) == 2
    assert catalog.storage.exists(catalog.manifest_path(40)) is False  # absent is still False, not an error


def _save(committer: Committer, step: int, world: int = 2):
    """Every rank writes its shard of `step` and hands its receipt to `committer`; the last one's Commit."""
    state, storage = make_state(step), committer.catalog.storage
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    done = None
    for rank in range(world):
        receipt = write_shard(storage, step, rank, {n: state[n] for n in owned_by(rank, world, sizes)}, blocking_s=0.0)
        extra = {"engine": {"next_step": step}} if rank == 0 else {}
        done = committer.on_receipt(receipt, extra, world, 0, {"dp": world}, lambda samples: {})
    return done


def test_gc_after_a_commit_that_meets_a_connection_error_logs_and_deletes_nothing(catalog, caplog):
    # s3fs raises a connection failure as botocore's own exception, not an OSError.
    botocore = pytest.importorskip("botocore.exceptions")
    _stat_fails(catalog, 20, times=100, error=botocore.EndpointConnectionError(endpoint_url="http://s3:9000"))
    before = _files(catalog)
    committer = Committer(catalog, job="j", spec_hash="h", keep=1)
    committer.reset(30)
    assert _save(committer, 40).step == 40
    assert "retention after step 40 failed (EndpointConnectionError" in caplog.text
    assert set(before) <= set(_files(catalog))  # keep=1 would have deleted 10, 20 and 30 on a working store


def test_a_torn_manifest_found_by_the_creates_read_back_is_withdrawn_and_the_retry_commits(catalog, caplog):
    # A torn manifest of step 40 is in place (the withdrawal after a torn write could not run): the
    # exclusive create answers "exists", and its read-back finds bytes that are not a manifest.
    torn = catalog.manifest_path(40)
    catalog.storage.fs.makedirs(torn.rsplit("/", 1)[0], exist_ok=True)
    catalog.storage.fs.pipe_file(torn, b'{"job": "j", "step": 4')
    dropped: list[tuple[int, str]] = []
    committer = Committer(catalog, job="j", spec_hash="h", keep=5, on_dropped=lambda s, why: dropped.append((s, why)))
    committer.reset(30)
    assert _save(committer, 40).step == 40 and dropped == []
    assert "manifest commit failed (CorruptCheckpoint: step 40: the manifest is not JSON" in caplog.text
    assert catalog.committed_steps() == [10, 20, 30, 40] and catalog.read_manifest(40).step == 40


def test_a_commit_that_landed_with_its_reply_lost_and_its_read_backs_failing_counts_as_committed(catalog, caplog):
    # A flapping store: the first create lands but its reply is lost (a timeout), and the next two
    # reads of the manifest fail too (the check after the failed create, the retry's read-back).
    storage, path = catalog.storage, catalog.manifest_path(40)
    real_create, real_read, failed_reads = storage._create, storage.read, []

    def create_then_time_out(target, data):
        real_create(target, data)
        if target == path and not failed_reads:
            raise OSError(errno.ETIMEDOUT, "Connection timed out")

    def read(target, *args, **kwargs):
        if target == path and len(failed_reads) < 2:
            failed_reads.append(target)
            raise OSError(errno.ECONNRESET, "Connection reset by peer")
        return real_read(target, *args, **kwargs)

    storage._create, storage.read = create_then_time_out, read
    dropped: list[tuple[int, str]] = []
    committer = Committer(catalog, job="j", spec_hash="h", keep=5, on_dropped=lambda s, why: dropped.append((s, why)))
    committer.reset(30)
    done = _save(committer, 40)
    assert len(failed_reads) == 2 and "manifest commit failed" in caplog.text  # both creates did fail
    assert done is not None and done.step == 40 and committer.latest == 40 and dropped == []
    committer.abandon(40, "a rank's error that arrived after its receipt")  # late: the step is committed
    assert dropped == [] and catalog.committed_steps() == [10, 20, 30, 40]


def test_a_leased_root_the_store_lists_empty_is_no_fresh_start_and_nothing_is_deleted(tmp_path):
    # The job's root vanishes from the store's answers mid-run (a bucket failover answering
    # NoSuchBucket, a dropped mount): listed as empty, the restore would start the job from step 0
    # and its retention delete the history it could not see. The lease's own directory is always
    # under a leased root, so a listing without it is the store's fault: retried, then an error.
    from ckpt.catalog import RootNotListed
    from ckpt.errors import TransientStorageError
    from ckpt.ownership import OwnerLease

    root = tmp_path / "job"
    lease = OwnerLease.claim(Storage(f"file://{root}"), "here", lease_s=600.0)  # no beat during the test
    try:
        catalog = Catalog(Storage(f"file://{root}"), owner=lease)
        for step in (10, 20):
            save_checkpoint(catalog, step, make_state(step), world=2)
        root.rename(tmp_path / "away")
        with pytest.raises(RootNotListed, match="lists without owner/"):
            catalog.all_steps()
        with pytest.raises(TransientStorageError, match="listing the committed checkpoints"):
            RestorePolicy(catalog, read_retry_s=0.2).restore_point()
        assert Catalog(Storage(f"file://{root}")).all_steps() == []  # a reader without a lease: as before
        (tmp_path / "away").rename(root)
        assert RestorePolicy(catalog, read_retry_s=0.2).restore_point() == 20
        assert catalog.committed_steps() == [10, 20]
    finally:
        lease.release()


def test_an_unfinished_save_whose_manifest_lands_after_gc_planned_it_is_kept(catalog, caplog):
    """A create that stalled in a store client's retries (its driver lost the root meanwhile) lands after
    the new holder's GC listed the step as an unfinished save: it is a commit now, and GC leaves it."""
    write_shard(catalog.storage, 25, 0, make_state(25), blocking_s=0.0)
    plan = catalog.gc_plan(keep=5)
    assert plan.orphans == [25]
    save_checkpoint(catalog, 25, make_state(25), world=2)  # the late create
    catalog.apply_gc(plan)
    assert catalog.committed_steps() == [10, 20, 25, 30]
    assert "left step 25: its manifest appeared" in caplog.text


def test_a_create_that_failed_twice_and_lands_after_the_next_commits_gc_names_shards_still_there(catalog):
    """Both creates of step 40 time out and no manifest is found after them, yet the store applies one of
    the stalled requests later: the shards it names must not have been collected as an unfinished save."""
    from ckpt.reader import verify_checkpoint

    storage, path = catalog.storage, catalog.manifest_path(40)
    real_create, held = storage._create, []

    def stalled(target, data):
        if target == path:
            held.append(data)
            raise OSError(errno.ETIMEDOUT, "timed out")
        real_create(target, data)

    storage._create = stalled
    committer = Committer(catalog, job="j", spec_hash="h", keep=5)
    committer.reset(30)
    assert _save(committer, 40) is None  # failed twice, not found landed
    storage._create = real_create
    assert _save(committer, 50).step == 50  # its GC would take step 40's directory for an orphan
    real_create(path, held[0])  # the stalled request lands
    verify_checkpoint(catalog, 40, ReadRetry(0.0))  # every shard it names is there
