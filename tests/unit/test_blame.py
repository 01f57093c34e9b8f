"""Which rank a failure is blamed on: the rank whose error is its own, not the peers whose collectives
failed because of it, whichever outcome the controller saw first (orchestrator.controller.blame)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from orchestrator.cluster.worker_group import RankOutcome
from orchestrator.controller.blame import Blame
from orchestrator.controller.errors import is_peer_failure

GLOO_PEER = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:45738. This is typically caused by a remote worker crashing.")
OWN = "ValueError: expected a batch of 4 rows, got 3"


def _blame() -> Blame:
    faults = SimpleNamespace(take_fired=lambda: None, disarm_slow=lambda ranks: None)
    return Blame(faults, SimpleNamespace(last_step=12, completed_steps=lambda: 12))


def test_the_rank_with_its_own_error_is_blamed_not_the_first_peer_to_report():
    outcomes = [RankOutcome(0, "aborted", {"error": GLOO_PEER, "step": 12}),
                RankOutcome(5, "aborted", {"error": OWN, "step": 12}),
                RankOutcome(1, "aborted", {"error": "DistBackendError: NCCL communicator was aborted", "step": 12})]
    failure = _blame().from_outcomes(outcomes)
    assert (failure.kind, failure.rank, failure.message) == ("rank_error", 5, OWN)


def test_once_every_outcome_is_in_a_peer_blamed_first_gives_way_to_the_cause():
    blame = _blame()
    failure = blame.from_outcomes([RankOutcome(0, "aborted", {"error": GLOO_PEER, "step": 12})])
    assert failure.rank == 0  # all it knows so far
    failure.errors.update({5: OWN, 3: GLOO_PEER})  # the release collects the others' outcomes
    failure.record = SimpleNamespace(kind=None, rank=None)
    summary = blame.attribute(failure, dead=[], stuck=[])
    assert (summary.rank, summary.error) == (5, OWN) and failure.record.rank == 5
    assert summary.at == failure.detected_at  # the restart window counts failures by when they were noticed
    assert is_peer_failure(GLOO_PEER) and not is_peer_failure(OWN)


def test_a_node_the_release_found_gone_is_the_cause_of_its_ranks_deaths_and_peers_errors():
    # A crashed machine: no watchdog reported it; its rank 2 looked dead, rank 0's collective failed first.
    blame = _blame()
    failure = blame.from_outcomes([RankOutcome(0, "aborted", {"error": GLOO_PEER, "step": 12})])
    failure.errors.update({2: "node 0a1b2c3d4e5f lost", 3: "node 0a1b2c3d4e5f lost"})
    failure.record = SimpleNamespace(kind=None, rank=None, message=None)
    summary = blame.attribute(failure, dead=[], stuck=[], crashed={"0a1b2c3d4e5f" + "9" * 44: [2, 3]})
    assert (summary.kind, summary.rank) == ("node_lost", 2)
    assert (failure.record.kind, failure.record.rank) == ("node_lost", 2)
    assert failure.record.message == "node 0a1b2c3d4e5f lost (its raylet is gone)"


def test_a_gone_node_that_held_only_spares_takes_no_blame_from_the_ranks_own_error():
    blame = _blame()
    failure = blame.from_outcomes([RankOutcome(5, "aborted", {"error": OWN, "step": 12})])
    failure.record = SimpleNamespace(kind=None, rank=None, message=None)
    summary = blame.attribute(failure, dead=[], stuck=[], crashed={"f" * 56: []})
    assert (summary.kind, summary.rank, summary.error) == ("rank_error", 5, OWN)


def test_a_rank_s_own_error_on_a_live_node_stays_its_own_cause_when_a_node_is_gone_too():
    blame = _blame()
    failure = blame.from_outcomes([RankOutcome(5, "aborted", {"error": OWN, "step": 12})])
    failure.errors[2] = "node 0a1b2c3d4e5f lost"
    failure.record = SimpleNamespace(kind=None, rank=None, message=None)
    summary = blame.attribute(failure, dead=[], stuck=[], crashed={"0a1b2c3d4e5f" + "9" * 44: [2]})
    assert (summary.kind, summary.rank, summary.error) == ("rank_error", 5, OWN)


def test_a_hang_s_step_was_due_a_usual_step_after_the_last_progress_and_what_was_booked_since():
    """The hang limit ran out 30 s after the last progress; a step usually takes 2 s, and a save
    blocked the ranks 5 s after it (booked as checkpoint_save): the step was due at 7 s, and the
    23 s after that were the wait to be declared hung (detection), not 28 s."""
    faults = SimpleNamespace(take_fired=lambda: None)
    record = SimpleNamespace(last_step=12, completed_steps=lambda: 13, median_step_s=lambda: 2.0,
                             booked_since_step=5.0)
    failure = Blame(faults, record).hang(time.monotonic() - 30.0, limit_s=20.0)
    assert failure.kind == "hang" and failure.fault_time is None
    assert failure.onset == failure.stalled_at
    assert failure.detected_at - failure.stalled_at == pytest.approx(23.0, abs=0.5)
