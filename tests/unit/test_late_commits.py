"""A manifest create of a driver that lost its checkpoint root lands after the next driver took the
root over: the new holder neither restores nor deletes that late commit, and keeps its own."""

from __future__ import annotations

import logging

from ckpt.catalog import Catalog
from ckpt.late_commits import OWNER
from ckpt.ownership import OwnerLease
from ckpt.storage import Storage
from orchestrator.controller.restore_policy import LATE_COMMIT, RestorePolicy
from tests._checkpoints import make_state, save_checkpoint


def _takeover(tmp_path):
    """Driver A commits step 10 and releases the root (its create of step 30, stalled in a client's
    retries, still under way); driver B claims it."""
    url = f"file://{tmp_path}/job"
    old = OwnerLease.claim(Storage(url), "a", lease_s=600.0)
    save_checkpoint(Catalog(Storage(url), owner=old), 10, make_state(10), world=2)
    old.release()
    new = OwnerLease.claim(Storage(url), "b", lease_s=600.0)
    return url, old, new


def test_a_late_commit_of_the_driver_that_lost_the_root_is_neither_restored_nor_deleted(tmp_path, caplog):
    url, old, new = _takeover(tmp_path)
    try:
        catalog = Catalog(Storage(url), owner=new)
        assert catalog.read_manifest(10).state[OWNER] == {"epoch": old.epoch, "token": old.token}
        policy = RestorePolicy(catalog, read_retry_s=0.2)  # B's driver starts: the root's history is listed
        # A's stalled create lands now, while B places its ranks (its lease check passed long ago).
        save_checkpoint(Catalog(Storage(url)), 30, make_state(30), world=2)
        with caplog.at_level(logging.WARNING, logger="orchestrator.controller.restore_policy"):
            assert policy.restore_point() == 10  # not step 30: another history's, maybe another spec's
        assert policy.bad[30] == LATE_COMMIT and "checkpoint step 30: committed by a driver" in caplog.text
        assert Catalog(Storage(url)).committed_steps() == [10, 30]  # kept: nothing here deletes
    finally:
        new.release()


def test_the_holder_s_own_commits_are_restored_booked_or_not(tmp_path):
    url, _, new = _takeover(tmp_path)
    try:
        catalog = Catalog(Storage(url), owner=new)
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        assert policy.restore_point() == 10
        save_checkpoint(catalog, 20, make_state(20), world=2)
        policy.on_committed(20)  # booked by the controller
        assert policy.restore_point() == 20
        save_checkpoint(catalog, 40, make_state(40), world=2)  # landed, its answer lost: never booked
        assert policy.restore_point() == 40 and policy.bad == {}  # known by the epoch it carries
        assert catalog.read_manifest(40).state[OWNER]["token"] == new.token
    finally:
        new.release()


def test_a_late_commit_in_a_root_with_no_history_of_the_job_s_own_starts_it_from_step_0(tmp_path):
    url = f"file://{tmp_path}/job"
    old = OwnerLease.claim(Storage(url), "a", lease_s=600.0)
    old.release()
    new = OwnerLease.claim(Storage(url), "b", lease_s=600.0)
    try:
        policy = RestorePolicy(Catalog(Storage(url), owner=new), read_retry_s=0.2)  # nothing committed
        save_checkpoint(Catalog(Storage(url)), 30, make_state(30), world=2)  # A's late create
        assert policy.restore_point() is None  # as without it, not NoRestorePoint
        said = []
        assert not policy.kept_intact(30, "h", said.append)  # never taken as the job's final checkpoint
        assert "committed by a driver that no longer owned" in said[0]
    finally:
        new.release()


def test_a_manifest_that_does_not_read_for_the_store_is_retried_then_fails_the_restore(tmp_path, monkeypatch):
    import pytest

    from ckpt.errors import TransientStorageError

    url, _, new = _takeover(tmp_path)
    try:
        catalog = Catalog(Storage(url), owner=new)
        policy = RestorePolicy(catalog, read_retry_s=0.2)
        save_checkpoint(Catalog(Storage(url)), 30, make_state(30), world=2)

        def store_down(step):
            raise ConnectionError("the store is down")

        monkeypatch.setattr(catalog, "read_manifest", store_down)
        with pytest.raises(TransientStorageError, match="reading who committed"):
            policy.restore_point()  # never restored while who committed it is unknown
        monkeypatch.undo()
        assert policy.restore_point() == 10
    finally:
        new.release()
