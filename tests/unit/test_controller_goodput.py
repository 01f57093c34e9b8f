"""Where the controller books wall time that is not a state's own: the cluster's capacity at placement,
and the run's end after its last state (tests/unit/test_goodput.py has the ledger itself)."""

from __future__ import annotations

import time

import pytest

from ckpt.storage import Storage
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)


def test_the_runs_end_after_its_last_state_is_booked_as_other_not_productive(tmp_path, rendezvous, monkeypatch):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    ctl = _controller(spec, workers, rendezvous, [])
    close = ctl.checkpoints.close
    monkeypatch.setattr(ctl.checkpoints, "close", lambda within_s: (time.sleep(0.3), close(within_s)))  # a slow store
    assert ctl.run().status == "succeeded"
    assert ctl.ledger.totals()["other"] >= 0.3  # the last create and retention pass settling trains nothing


def test_the_wait_for_the_clusters_capacity_at_placement_is_booked_as_waiting_for_resources(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    workers.placement_wait_s = 0.3  # the placement group's bundles granted only after this long
    ctl = _controller(spec, workers, rendezvous, [])
    assert ctl.run().status == "succeeded"
    totals = ctl.ledger.totals()  # moved out of startup, where PLACING books
    assert totals["waiting_for_resources"] == pytest.approx(0.3)
    assert sum(totals.values()) == pytest.approx(ctl.ledger.wall())


def test_a_placement_wait_that_times_out_is_booked_as_waiting_for_resources(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    workers.placement_wait_s, workers.place_error = 0.3, "4 bundles could not be placed within 0 s"
    ctl = _controller(spec, workers, rendezvous, [])
    assert ctl.run().status == "failed"
    assert ctl.ledger.totals()["waiting_for_resources"] == pytest.approx(0.3)  # not startup's
