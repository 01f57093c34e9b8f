"""A job's placement group name (orchestrator/cluster/stale_groups.py): one per checkpoint root, and the
removal of a former driver's group a best effort that never fails the placement (the real removal is
tests/ray/test_ownership_run.py's, against a stopped driver)."""

from __future__ import annotations

import logging

from orchestrator.cluster import stale_groups


def test_every_driver_of_a_root_names_its_group_alike_and_another_root_otherwise():
    name = stale_groups.group_name("file:///ckpt/job")
    assert name == stale_groups.group_name("file:///ckpt/job") and name.startswith(stale_groups.PREFIX)
    assert name != stale_groups.group_name("file:///ckpt/other-job")


def test_a_cluster_that_cannot_list_its_groups_leaves_the_placement_to_wait_as_before(monkeypatch, caplog):
    def refused():
        raise RuntimeError("not supported through the Ray client")

    monkeypatch.setattr(stale_groups, "placement_group_table", refused)
    with caplog.at_level(logging.WARNING):
        assert stale_groups.remove_stale(stale_groups.group_name("file:///ckpt/job")) == 0
    assert "could not look for a former driver's placement groups" in caplog.text
