"""Release from a broken collective (orchestrator/rank/comm_abort.py), on 4 gloo ranks.

Each scenario (bench/release/scenario.py; bench.release measures the same ones at 4 and 8 ranks) runs one
collective in a loop on 4 ranks; rank 1 SIGKILLs itself while the others are inside it. The process-group
timeout is 60 s, so a survivor out within RELEASE_S was released by the mechanism, not the timeout.
Then the 3 survivors form a new group under a new store prefix and check an all_reduce sum in it.

Every collective the engine uses or will use is covered. gloo on torch 2.13 implements them all,
reduce-scatter included (`dist.reduce_scatter_single`; `reduce_scatter_tensor` is its deprecated name).
"""

import pytest

from bench.release.scenario import COLLECTIVES, VICTIM, run_scenario

pytestmark = pytest.mark.dist

RELEASE_S = 2.0
WORLD_SIZE = 4
SURVIVORS = [r for r in range(WORLD_SIZE) if r != VICTIM]


def assert_reformed(report: dict) -> None:
    assert report["sums"] == [report["expected"]] * len(SURVIVORS), report


@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_abort_on_error_releases_every_survivor(collective):
    """Every survivor that sees an error calls sockets.abort() then destroy_process_group():
    the error cascades, and every survivor is out of its collective within RELEASE_S of the kill."""
    report = run_scenario(collective, WORLD_SIZE, "abort")

    assert report["released"], f"{collective}: rank(s) {report['blocked']} still blocked"
    assert report["release_s"] < RELEASE_S, report
    assert sorted(report["errors"]) == SURVIVORS  # every survivor left through an error
    assert_reformed(report)


@pytest.mark.parametrize("collective", ["all_reduce_1mb", "ddp", "mesh"])
def test_watcher_releases_a_survivor_nobody_else_releases(collective):
    """Survivors that see an error do nothing; a survivor whose own collective never errors
    (not a neighbour of the dead rank) stays blocked until the controller sets the abort key,
    and then a second thread in it calls sockets.abort() and releases it."""
    report = run_scenario(collective, WORLD_SIZE, "watcher")

    assert report["blocked"], "no survivor was left blocked: the watcher path was not exercised"
    assert report["released"], report
    assert report["release_s"] < RELEASE_S, report
    assert_reformed(report)
