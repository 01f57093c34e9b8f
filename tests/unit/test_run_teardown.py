"""`undying run`'s teardown: every step runs whatever another raised (the owner lease release among
them), and from the controller's start to the teardown's end SIGINT/SIGTERM only reach the
controller's handler, never as an exception that would cut the teardown short."""

from __future__ import annotations

import os
import signal

import pytest

from orchestrator.cli.teardown import StartUpSignals, StoppedBeforeStart, route_signals, teardown


def test_every_teardown_step_runs_whatever_the_others_raise(capsys):
    ran = []

    def closes(name):
        return lambda: ran.append(name)

    def fails():
        ran.append("trackers")
        raise RuntimeError("W&B unreachable")

    teardown([closes("workers"), fails, None, closes("lease"), closes("metrics"), closes("ray")])
    assert ran == ["workers", "trackers", "lease", "metrics", "ray"]
    err = capsys.readouterr().err
    assert "teardown" in err and "RuntimeError: W&B unreachable" in err


def test_a_signal_during_the_teardown_still_releases_the_lease_then_ends_the_driver():
    # Before the signals are routed (the driver's set-up), a second SIGTERM is Ray's SystemExit.
    ran = []

    def interrupted():
        ran.append("workers")
        raise SystemExit(1)

    with pytest.raises(SystemExit):
        teardown([interrupted, lambda: ran.append("lease"), lambda: ran.append("ray")])
    assert ran == ["workers", "lease", "ray"]


def test_signals_go_to_the_handler_until_restored():
    seen = []
    before = signal.getsignal(signal.SIGINT)
    restore = route_signals(lambda signum, frame: seen.append(signum))
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: recorded, no KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGINT, signal.SIGTERM]
    restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_the_first_signal_of_the_set_up_stops_it_and_a_second_leaves_the_teardown_whole():
    start_up = StartUpSignals()
    restore = route_signals(start_up.on_signal)
    try:
        with pytest.raises(StoppedBeforeStart, match="SIGINT while the job was set up"):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the owner lease's watch
        ran = []
        teardown([lambda: os.kill(os.getpid(), signal.SIGTERM), lambda: ran.append("lease")])
        assert ran == ["lease"] and start_up.signals == ["SIGINT", "SIGTERM"]
    finally:
        restore()


def test_once_the_driver_tears_down_a_start_up_signal_is_recorded_not_raised():
    # A set-up that returned early (exit 2): its teardown runs under the start-up handler still.
    start_up = StartUpSignals()
    restore = route_signals(start_up.on_signal)
    try:
        start_up.end()
        ran = []
        teardown([lambda: os.kill(os.getpid(), signal.SIGTERM), lambda: ran.append("lease")])
        assert ran == ["lease"] and start_up.signals == ["SIGTERM"]
    finally:
        restore()
