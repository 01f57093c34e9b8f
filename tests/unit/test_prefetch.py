"""trainer.prefetch.StepPrefetcher: the token loader's read-ahead."""

import threading

import pytest

from trainer.prefetch import StepPrefetcher


def test_get_returns_the_load_and_prefetches_the_next_steps_of_the_same_place():
    loaded = []

    def load(key):
        loaded.append(key)
        return key[0] * 10 + key[1]

    pf = StepPrefetcher(load, steps=2)
    assert pf.get((0, 3)) == 3
    assert sorted(pf.ahead()) == [(1, 3), (2, 3)]
    assert pf.get((1, 3)) == 13  # served from the thread
    assert sorted(pf.ahead()) == [(2, 3), (3, 3)]
    pf.close()
    assert loaded.count((1, 3)) == 1  # loaded once, ahead, not again on `get`


def test_a_new_place_or_a_rollback_drops_what_was_prefetched():
    release = threading.Event()

    def load(key):
        if key[0] > 0:
            release.wait(5)
        return key

    pf = StepPrefetcher(load, steps=3)
    pf.get((0, "dp2"))
    pf.get((0, "dp1"))  # an elastic change of layout: nothing of "dp2" is kept
    assert sorted(pf.ahead()) == [(1, "dp1"), (2, "dp1"), (3, "dp1")]
    release.set()
    pf.close()
    assert pf.ahead() == []


def test_an_error_in_a_load_ahead_reaches_the_step_that_needs_it():
    def load(key):
        if key[0] == 1:
            raise OSError("read failed")
        return key

    pf = StepPrefetcher(load, steps=1)
    pf.get((0,))
    with pytest.raises(OSError, match="read failed"):
        pf.get((1,))
    pf.close()


def test_prefetch_steps_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="data.prefetch_steps"):
        StepPrefetcher(lambda key: key, steps=0)
