"""A manifest create of a driver that lost its checkpoint root lands after the next driver took the
root over: the new holder moves that late commit aside (kept as evidence), neither restores nor
counts it, and commits its own save of that step; its own commits are known, booked or not."""

from __future__ import annotations

import contextlib
import logging

import pytest

from ckpt.catalog import Catalog
from ckpt.errors import TransientStorageError
from ckpt.late_commits import LATE_PREFIX, OWNER, record_history
from ckpt.manifest import step_dir
from ckpt.ownership import OwnerLease
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry
from orchestrator.controller.restore_policy import RestorePolicy
from tests._checkpoints import make_state, save_checkpoint


@contextlib.contextmanager
def _takeover(tmp_path, commit_first: bool = True):
    """Driver A commits step 10 (or nothing) and releases the root, its create of a later step stalled in
    a client's retries; driver B claims the root and lists its history. Yields (url, A's catalog, B's
    catalog, B's lease), and B releases the root after: A's catalog still commits under A's claim (its
    lease check passed long ago)."""
    url = f"file://{tmp_path}/job"
    old = OwnerLease.claim(Storage(url), "a", lease_s=600.0)
    stale = Catalog(Storage(url), owner=old)
    if commit_first:
        save_checkpoint(stale, 10, make_state(10), world=2)
    old.release()
    stale.fence = lambda: None  # the check that passed before the create stalled
    new = OwnerLease.claim(Storage(url), "b", lease_s=600.0)
    catalog = Catalog(Storage(url), owner=new)
    record_history(catalog, ReadRetry(0.2))
    try:
        yield url, stale, catalog, new
    finally:
        new.release()


def test_a_late_commit_is_moved_aside_and_neither_restored_nor_counted(tmp_path, caplog):
    with _takeover(tmp_path) as (url, stale, catalog, new):
        assert catalog.read_manifest(10).state[OWNER]["epoch"] == stale.owner_claim()["epoch"]
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        save_checkpoint(stale, 15, make_state(15), world=2)  # A's create lands while B places its ranks
        with caplog.at_level(logging.WARNING, logger="ckpt.late_commits"):
            assert policy.restore_point() == 10  # not step 15: another history's, maybe another spec's
        assert "checkpoint step 15 was committed by a driver that no longer owned" in caplog.text
        assert Catalog(Storage(url)).committed_steps() == [10]  # for every later run too
        names = Storage(url).listdir(Storage(url).path(step_dir(15)))
        assert any(n.startswith(LATE_PREFIX) for n in names) and any(n.startswith("shard-") for n in names)
        save_checkpoint(catalog, 20, make_state(20), world=2)
        assert catalog.collect_garbage(before=20) == []  # below the newest commit, kept as evidence
        assert policy.restore_point() == 20


def test_the_holder_s_save_of_a_step_a_late_commit_took_commits_its_own(tmp_path):
    with _takeover(tmp_path) as (url, stale, catalog, new):
        save_checkpoint(stale, 30, make_state(30), world=2)  # landed after the last restore's listing
        save_checkpoint(catalog, 30, make_state(31), world=2)  # B reaches step 30 and saves it
        manifest = catalog.read_manifest(30)
        assert manifest.state[OWNER] == catalog.owner_claim() and Catalog(Storage(url)).committed_steps() == [10, 30]
        assert any(n.startswith(LATE_PREFIX) for n in Storage(url).listdir(Storage(url).path(step_dir(30))))


def test_the_holder_s_own_commits_are_restored_booked_or_not(tmp_path):
    with _takeover(tmp_path) as (_, _, catalog, new):
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        assert policy.restore_point() == 10
        save_checkpoint(catalog, 20, make_state(20), world=2)
        policy.on_committed(20)  # booked by the controller: known without reading its manifest
        catalog.read_manifest = lambda step: pytest.fail(f"read the manifest of booked step {step}")
        assert policy.restore_point() == 20
        del catalog.read_manifest
        save_checkpoint(catalog, 40, make_state(40), world=2)  # landed, its answer lost: never booked
        assert policy.restore_point() == 40  # known by the claim it carries


def test_a_claim_of_the_same_epoch_made_after_owner_was_wiped_is_not_ours(tmp_path):
    with _takeover(tmp_path) as (url, stale, catalog, new):
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        stale.owner_claim = lambda: {"epoch": new.epoch, "token": "another claim's"}
        save_checkpoint(stale, 30, make_state(30), world=2)
        assert policy.restore_point() == 10


def test_a_root_whose_only_commits_are_late_starts_from_step_0(tmp_path):
    with _takeover(tmp_path, commit_first=False) as (_, stale, catalog, new):
        policy = RestorePolicy(catalog, read_retry_s=0.2)  # nothing committed
        save_checkpoint(stale, 30, make_state(30), world=2)
        assert policy.restore_point() is None  # as without it, not NoRestorePoint


def test_a_manifest_that_does_not_read_for_the_store_is_retried_then_fails_the_restore(tmp_path, monkeypatch):
    with _takeover(tmp_path) as (_, stale, catalog, new):
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        save_checkpoint(stale, 30, make_state(30), world=2)

        def store_down(step):
            raise ConnectionError("the store is down")

        monkeypatch.setattr(catalog, "read_manifest", store_down)
        with pytest.raises(TransientStorageError, match="reading who committed"):
            policy.restore_point()  # never restored while who committed it is unknown
        monkeypatch.undo()
        assert policy.restore_point() == 10


def test_a_start_whose_history_the_store_will_not_list_is_refused(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from orchestrator.cli.root_lease import leased_catalog

    url = f"file://{tmp_path}/job"
    lease = OwnerLease.claim(Storage(url), "b", lease_s=600.0)
    try:
        spec = SimpleNamespace(checkpoint_root=url, checkpoint=SimpleNamespace(storage_options={}, read_retry_s=0.2))

        def refused(self):
            raise PermissionError(13, "Access Denied")

        monkeypatch.setattr(Catalog, "committed_steps", refused)
        assert leased_catalog(spec, lease) is None
        assert "the job cannot start: could not list the committed checkpoints" in capsys.readouterr().err
        monkeypatch.undo()
        assert leased_catalog(spec, lease).history == set()
    finally:
        lease.release()


def test_a_move_aside_the_store_refuses_still_leaves_the_late_commit_out(tmp_path, monkeypatch, caplog):
    with _takeover(tmp_path) as (_, stale, catalog, new):
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        save_checkpoint(stale, 30, make_state(30), world=2)

        def refused(step):
            raise PermissionError(13, "Access Denied")

        monkeypatch.setattr(catalog, "withdraw_late", refused)
        with caplog.at_level(logging.WARNING, logger="ckpt.late_commits"):
            assert policy.restore_point() == 10
        assert "moving it aside failed (PermissionError" in caplog.text
