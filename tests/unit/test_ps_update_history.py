"""A parameter-server job's update records a batch at a time (paramserver.update_history): a
server keeps only what the driver has not acknowledged, an answer lost on the way is sent again,
a rollback forgets the undone updates on both sides, and the driver folds committed records into
counts past its cap, so neither side's memory nor a poll's size grows with the job's length."""

from __future__ import annotations

import types

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from paramserver import update_history
from paramserver.actors import ServerStats
from paramserver.clocks import UpdateRecord
from paramserver.job import PSReport
from paramserver.update_history import RecordOutbox, UpdateHistory


def _records(server: int, steps: range, staleness: int = 0) -> list[UpdateRecord]:
    return [UpdateRecord(server, w, step, step, step + staleness, step) for step in steps for w in range(2)]


class FakeServer:
    """A server actor's `stats` as ServerActor answers it, over an outbox; `lost` drops its next answer,
    `stopped` keeps its answers from arriving (SIGSTOP) until `answer_late()`."""

    def __init__(self, index: int):
        self.index, self.new, self.outbox, self.dead, self.lost = index, [], RecordOutbox(), False, False
        self.stopped, self.late, self.moved = False, [], (0, 0)  # moved: (bytes in, bytes out) so far
        self.stats = types.SimpleNamespace(remote=self._stats)
        self.calls: list[int] = []

    def _stats(self, acked: int):
        self.calls.append(acked)
        if self.dead:
            return RayActorError()
        if self.stopped:
            self.late.append(Late(self, acked))
            return self.late[-1]
        new, self.new = self.new, []
        answer = ServerStats(self.index, 0, *self.moved, self.outbox.take(acked, new), self.outbox.batch)
        if self.lost:
            self.lost = False
            return GetTimeoutError()  # the call ran; its answer never reached the driver
        return answer


class Late:
    """A call a stopped server has not run: it runs, and its answer arrives, at `answer_late()`."""

    def __init__(self, server: FakeServer, acked: int):
        self.server, self.acked, self.answer = server, acked, None


def answer_late(server: FakeServer) -> None:
    server.stopped = False
    for call in server.late:
        call.answer = server._stats(call.acked)


def _arrived(call) -> bool:
    return not isinstance(call, Late) or call.answer is not None


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch):
    def get(answers, timeout=None):
        if not all(_arrived(a) for a in answers):
            raise GetTimeoutError()
        answers = [a.answer if isinstance(a, Late) else a for a in answers]
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        return answers

    def wait(calls, num_returns=1, timeout=None):
        assert timeout == 0, "the segment's metrics poll never waits"
        return [c for c in calls if _arrived(c)], [c for c in calls if not _arrived(c)]
    monkeypatch.setattr(update_history, "ray", types.SimpleNamespace(get=get, wait=wait))


def test_each_record_reaches_the_driver_once_and_the_server_keeps_only_the_unacknowledged():
    servers, seen = [FakeServer(0), FakeServer(1)], []
    history = UpdateHistory(on_stats=lambda stats: seen.append(sum(len(s.records) for s in stats)))
    servers[0].new, servers[1].new = _records(0, range(0, 2)), _records(1, range(0, 2))
    history.poll(servers)
    servers[0].new = _records(0, range(2, 4))
    servers[0].lost = True
    assert history.poll(servers) is None  # its answer was lost: nothing taken, nothing acknowledged
    servers[0].new = _records(0, range(4, 5))
    history.poll(servers)  # batch 2 again, with batch 3
    assert len(servers[0].outbox.pending) == 2 and servers[0].calls == [0, 1, 1]
    history.poll(servers)  # acknowledges batches 2 and 3: the server lets them go
    assert servers[0].outbox.pending == [] and servers[1].outbox.pending == []
    steps = sorted((r.server, r.worker, r.step) for r in history.kept)
    assert steps == sorted({(k, w, s) for k in range(2) for w in range(2) for s in range(5 if k == 0 else 2)})
    assert seen == [8, 6, 0]  # the lost answer never reached on_stats; the resent batch did, once


def test_a_dead_server_fails_a_drain_and_a_rollback_forgets_the_undone_updates_on_both_sides():
    server, history = FakeServer(0), UpdateHistory()
    server.new = _records(0, range(0, 6))
    history.drain([server])
    server.new, server.lost = _records(0, range(6, 8)), True
    assert history.poll([server]) is None  # steps 6-7 wait in the server's outbox, unacknowledged
    server.dead = True
    with pytest.raises(RayActorError):
        history.drain([server])  # before a save: the save would find the dead server too
    server.dead = False  # (another server died: this one is restored to step 4 and reopened)
    server.outbox.drop_from(4)
    history.rewind(4)
    history.poll([server])
    assert sorted({r.step for r in history.kept}) == [0, 1, 2, 3] and history.updates == 8


def test_committed_records_past_the_cap_are_counted_not_kept():
    server, history = FakeServer(0), UpdateHistory(keep=10)
    server.new = _records(0, range(0, 4)) + _records(0, range(4, 8), staleness=2)  # 16 records
    history.poll([server])
    history.committed(6)  # records of steps 0-5 may be folded; 6-7 must stay (a rollback may undo them)
    assert len(history.kept) == 5 and min(r.step for r in history.kept) >= 5
    assert history.updates == 16 and history.staleness_histogram() == {0: 8, 2: 8}
    history.rewind(6)  # the steps after the commit undone
    assert history.updates == 12 and history.staleness_histogram() == {0: 8, 2: 4}
    history.committed(6)  # under the cap: nothing more to fold
    assert len(history.kept) == 1


def test_without_checkpoints_any_record_folds_and_a_restart_from_step_0_forgets_every_count(caplog):
    server, history = FakeServer(0), UpdateHistory(keep=10, foldable_below=float("inf"))
    server.new = _records(0, range(0, 8), staleness=1)
    history.poll([server])  # 16 > 10: folded at once, down to 5
    assert len(history.kept) == 5 and history.updates == 16 and history.folded_below == 6
    history.rewind(3)  # below the folded steps (an older commit than the newest): said, counts kept
    assert "undid updates already counted" in caplog.text and history.updates == 11
    history.rewind(0)
    assert history.updates == 0 and history.staleness_histogram() == {}


def test_a_stopped_server_holds_no_poll_and_its_records_arrive_once_whatever_answers_late(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(update_history, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    servers, seen = [FakeServer(0), FakeServer(1)], []
    history = UpdateHistory(on_stats=lambda stats: seen.append(sum(len(s.records) for s in stats)))
    servers[0].new, servers[1].new = _records(0, range(0, 2)), _records(1, range(0, 2))
    history.ask(servers)
    assert history.answered() is not None and seen == [8]
    servers[0].new, servers[1].new = _records(0, range(2, 3)), _records(1, range(2, 3))
    servers[1].stopped = True
    history.ask(servers)
    assert history.answered() is None  # server 1 has not answered: nothing taken, nothing waited for
    history.ask(servers)  # one ask at a time: no second call while the first is out
    assert servers[0].calls == [0, 1]
    now[0] = update_history.POLL_TIMEOUT_S
    assert history.answered() is None and history._asked is None  # dropped: the next ask asks again
    answer_late(servers[1])  # the dropped ask's call ran at last; its answer is never read
    history.ask(servers)
    assert history.answered() is not None
    servers[0].new = _records(0, range(3, 4))
    history.ask(servers)
    history.drain(servers)  # before a save: takes what the outstanding ask would have carried
    assert history.answered() is None  # dropped by the drain, not taken twice
    steps = sorted((r.server, r.worker, r.step) for r in history.kept)
    assert steps == sorted({(k, w, s) for k in range(2) for w in range(2) for s in range(4 if k == 0 else 3)})
    assert seen == [8, 4, 2]


def test_a_rollback_drops_an_outstanding_ask_whose_answers_carry_undone_updates():
    server, history = FakeServer(0), UpdateHistory()
    server.new = _records(0, range(0, 4))
    history.ask([server])
    server.outbox.drop_from(2)  # the call ran before the restore; its answer is read after the rewind
    history.rewind(2)
    assert history.answered() is None and history.kept == []
    history.poll([server])
    assert sorted({r.step for r in history.kept}) == [0, 1]


def test_bytes_moved_count_every_actor_a_server_had_not_only_its_replacement():
    old, other, history = FakeServer(0), FakeServer(1), UpdateHistory()
    old.moved, other.moved = (300, 100), (50, 50)
    history.poll([old, other])
    old.moved = (400, 200)
    history.poll([old, other])
    new = FakeServer(0)  # server 0's replacement: its counters start again from 0
    new.moved = (30, 10)
    history.poll([new, other])
    new.moved = (60, 20)
    history.poll([new, other])
    assert history.bytes_moved() == {0: 600 + 80, 1: 100}
    # The report divides by every step executed: 4 kept, 1 a rollback threw away (its bytes moved too),
    # which is 2 executions of the 2 workers'.
    report = PSReport("bsp", 2, 2, 100, [50, 50], [1.0] * 4, 1.0, history=history, redone=2)
    assert report.bytes_per_step() == (pytest.approx(780 / 5), [pytest.approx(680 / 5), pytest.approx(100 / 5)])
