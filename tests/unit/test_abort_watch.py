"""The abort watcher keeps watching through a store that fails for a while, and a watcher whose
generation ended while it read the key touches nothing (the next generation has its own)."""

from __future__ import annotations

import threading

from orchestrator.rank import abort_watch


class _Sockets:
    def __init__(self):
        self.aborted = 0

    def abort(self):
        self.aborted += 1


class _Store:
    def __init__(self, answers, on_read=None):
        self.answers, self.on_read = list(answers), on_read

    def abort_requested(self):
        if self.on_read:
            self.on_read()
        answer = self.answers.pop(0) if self.answers else False
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_failing_store_is_retried_and_the_abort_still_lands(monkeypatch):
    monkeypatch.setattr(abort_watch, "RETRY_S", 0.01)
    abort, over, sockets = threading.Event(), threading.Event(), _Sockets()
    store = _Store([ConnectionError("loaded"), TimeoutError("slow"), False, True])
    abort_watch.watch_abort(store, over, abort, sockets)
    assert abort.is_set() and sockets.aborted == 1 and store.answers == []


def test_a_watcher_whose_generation_ended_during_its_read_touches_nothing():
    abort, over, sockets = threading.Event(), threading.Event(), _Sockets()
    store = _Store([True], on_read=over.set)  # train returned while the round trip was under way
    abort_watch.watch_abort(store, over, abort, sockets)
    assert not abort.is_set() and sockets.aborted == 0
