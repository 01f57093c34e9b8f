"""The controller's RESTORING -> RUNNING line names the slowest rank's engine build and load."""

from orchestrator.controller.telemetry import slowest_restore


def test_slowest_rank_is_named_with_its_build_and_load_times():
    results = [{"rank": 0, "seconds": 0.12, "build_s": 0.05, "load_s": 0.07},
               {"rank": 3, "seconds": 0.31, "build_s": 0.21, "load_s": 0.10},
               {"rank": 1, "seconds": 0.20, "build_s": 0.15, "load_s": 0.05}]
    assert slowest_restore(results) == " (slowest rank 3: engine 0.21 s, load 0.10 s)"


def test_answers_without_times_add_nothing():
    assert slowest_restore([{"seconds": 0.3}, None]) == ""
    assert slowest_restore([]) == ""
