"""The goodput snapshot a successor controller resumes from: arithmetic, persistence, failures."""

from __future__ import annotations

import pytest

from ckpt.storage import Storage
from monitor.goodput import GoodputLedger
from orchestrator.controller.ledger_snapshot import SNAPSHOT_FILE, LedgerSnapshots, resume_totals

AT_COMMIT = {"productive": 100.0, "startup": 5.0, "checkpoint_save": 2.0}


def test_a_newer_snapshot_books_the_rolled_back_steps_and_the_downtime():
    snapshot = {"time": 1000.0, "totals": {"productive": 130.0, "startup": 5.0, "checkpoint_save": 3.0}}
    totals = resume_totals(AT_COMMIT, 990.0, snapshot, started_at=1042.5)
    assert totals == {"productive": 100.0, "startup": 5.0, "checkpoint_save": 3.0, "lost_work": 30.0,
                      "other": 42.5}
    # Every second up to the successor's start is in some bucket: the snapshot's wall plus the gap.
    assert sum(totals.values()) == pytest.approx(sum(snapshot["totals"].values()) + 42.5)


def test_an_older_snapshot_or_none_resumes_the_commits_ledger_and_books_the_time_since_the_commit():
    # A controller killed right after a commit: its last periodic snapshot predates the commit.
    older = {"time": 1000.0, "totals": {"productive": 90.0, "startup": 5.0}}
    expected = dict(AT_COMMIT, lost_work=0.0, other=12.0)
    assert resume_totals(AT_COMMIT, 1003.0, older, started_at=1015.0) == expected
    assert resume_totals(AT_COMMIT, 1003.0, None, started_at=1015.0) == expected
    # A clock that went back books no negative downtime.
    snapshot = {"time": 3000.0, "totals": dict(AT_COMMIT)}
    assert resume_totals(AT_COMMIT, 2990.0, snapshot, started_at=2000.0)["other"] == 0.0


def test_after_a_controller_that_ended_on_its_own_the_wait_for_a_rerun_is_not_the_jobs():
    ended = {"time": 1000.0, "totals": {"productive": 120.0, "startup": 5.0, "checkpoint_save": 2.0}, "ended": True}
    totals = resume_totals(AT_COMMIT, 990.0, ended, started_at=90000.0)
    assert totals == {"productive": 100.0, "startup": 5.0, "checkpoint_save": 2.0, "lost_work": 20.0}


def test_snapshots_round_trip_every_few_seconds_and_a_failed_write_is_not_fatal(tmp_path, caplog):
    now = [0.0]
    storage = Storage(f"file://{tmp_path}/job")
    snapshots = LedgerSnapshots(storage, every_s=5.0, clock=lambda: now[0])
    assert snapshots.load() is None
    ledger = GoodputLedger(carried={"productive": 7.0})
    snapshots.maybe_save(ledger)
    first = snapshots.load()
    assert first["totals"]["productive"] >= 7.0 and first["ended"] is False
    ledger = GoodputLedger(carried={"productive": 9.0})
    now[0] = 4.0
    snapshots.maybe_save(ledger)  # too soon
    assert snapshots.load() == first
    now[0] = 5.0
    snapshots.maybe_save(ledger)
    assert snapshots.load()["totals"]["productive"] >= 9.0
    snapshots.save(ledger, ended=True)
    assert snapshots.load()["ended"] is True
    (tmp_path / "job" / SNAPSHOT_FILE).write_text("{not json")
    assert snapshots.load() is None and "ignoring the goodput snapshot" in caplog.text
    (tmp_path / "job" / SNAPSHOT_FILE).write_text('{"time": 1, "totals": {"productive": -3}}')
    assert snapshots.load() is None

    broken = LedgerSnapshots(Storage(f"file://{tmp_path}/job"), every_s=0.0)
    broken.storage.atomic_writer = _failing_writer
    broken.save(ledger)
    broken.save(ledger)
    assert caplog.text.count("could not save the goodput snapshot") == 1


def _failing_writer(path):
    raise OSError("disk full")


def test_an_unreadable_snapshot_is_ignored_so_the_restore_resumes_the_commits_ledger(tmp_path, caplog):
    class Unreadable:
        def path(self, *parts):
            return "/".join(parts)

        def read(self, path):
            raise OSError(5, "injected storage_error on read")

    with caplog.at_level("WARNING"):
        assert LedgerSnapshots(Unreadable()).load() is None
    assert "ignoring the goodput snapshot" in caplog.text


def test_a_checkpoints_ledger_is_carried_once_and_unknown_buckets_are_dropped(tmp_path):
    from types import SimpleNamespace

    from orchestrator.controller.ledger_snapshot import carry_from_checkpoint

    manifest = SimpleNamespace(created_at=100.0, state={"goodput": {"productive": 30.0, "startup": 5.0,
                                                                     "from_a_newer_release": 1.0},
                                                        "history": [["restore", 0]]})
    ledger, history = GoodputLedger(), [["restore", 20]]
    snapshots = LedgerSnapshots(Storage(f"file://{tmp_path}/job"))
    carried = carry_from_checkpoint(manifest, ledger, history, snapshots, started_at=100.0)
    assert carried == 35.0 and history == [["restore", 0], ["restore", 20]]
    totals = ledger.totals()
    assert totals["productive"] == 30.0 and totals["startup"] >= 5.0 and "from_a_newer_release" not in totals


def test_a_driver_that_lost_the_root_saves_no_snapshot(tmp_path):
    from types import SimpleNamespace

    storage = Storage(f"file://{tmp_path}/job")
    lease = SimpleNamespace(lost=None, released=False)  # ckpt.ownership.OwnerLease's flags
    snapshots = LedgerSnapshots(storage, every_s=0.0, owner=lease)
    snapshots.save(GoodputLedger())
    saved = storage.read(storage.path(SNAPSHOT_FILE))
    lease.lost = "claimed by another driver"
    snapshots.save(GoodputLedger(), ended=True)
    assert storage.read(storage.path(SNAPSHOT_FILE)) == saved  # unchanged: the new owner writes it now



def test_a_write_queued_when_the_lease_was_released_writes_nothing(tmp_path):
    # The run's end gave up waiting for its last snapshot on a slow store and released the lease; the
    # next claimant takes the root at once, so the write still queued must not overwrite its snapshot.
    from types import SimpleNamespace

    storage = Storage(f"file://{tmp_path}/job")
    lease = SimpleNamespace(lost=None, released=False)
    snapshots = LedgerSnapshots(storage, every_s=0.0, owner=lease)
    snapshots.save(GoodputLedger())
    saved = storage.read(storage.path(SNAPSHOT_FILE))
    lease.released = True
    snapshots._write(b'{"stale": true}')  # the queued write, run after the release
    assert storage.read(storage.path(SNAPSHOT_FILE)) == saved


def test_in_the_background_a_hung_write_never_holds_the_controller_and_the_ended_one_is_waited_for(
        tmp_path, monkeypatch):
    import contextlib
    import threading
    import time

    from orchestrator.controller import ledger_snapshot

    monkeypatch.setattr(ledger_snapshot, "ENDED_WAIT_S", 0.2)
    storage = Storage(f"file://{tmp_path}/job")
    snapshots = LedgerSnapshots(storage, every_s=0.0, background=True)
    release, real_writer = threading.Event(), storage.atomic_writer

    @contextlib.contextmanager
    def hung_writer(path):
        assert release.wait(10)  # a store that does not answer
        with real_writer(path) as handle:
            yield handle

    storage.atomic_writer = hung_writer
    started = time.monotonic()
    snapshots.save(GoodputLedger(carried={"productive": 7.0}))  # the write waits on the snapshot's own thread
    snapshots.save(GoodputLedger(carried={"productive": 8.0}))  # queued behind it
    assert time.monotonic() - started < 5.0  # the hung store holds the writes 10 s
    snapshots.save(GoodputLedger(carried={"productive": 9.0}), ended=True)  # waits ENDED_WAIT_S, then gives up
    assert snapshots.load() is None
    release.set()
    assert snapshots.housekeeper.settle(5)
    last = snapshots.load()  # the newest one landed, the one between was dropped unwritten
    assert last["ended"] is True and last["totals"]["productive"] >= 9.0


def test_a_resumed_jobs_report_times_count_on_from_the_carried_job_seconds(tmp_path):
    import time
    from types import SimpleNamespace

    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.controller.ledger_snapshot import LedgerCarry

    ledger = GoodputLedger()
    record = JobRecord("j", 100, JobMetrics("j"), ledger, printer=lambda _: None)
    manifest = SimpleNamespace(created_at=time.time(), state={"goodput": {"productive": 120.0, "startup": 10.0}})
    clock = SimpleNamespace(skip_before=lambda job_s: None)
    before = record.job_seconds()
    record.on_layout(0, 2, 2, 1, 1)  # placed and formed before the restore: on this run's clock then
    LedgerCarry(lambda step: manifest, ledger, record, None, time.time(), clock).carry(20)
    assert record.job_seconds() - before == pytest.approx(130.0, abs=1.0)  # on the ledger's wall, as faults are
    assert record.job_seconds() == pytest.approx(ledger.wall(), abs=1.0)
    assert record.world[0].started_at == pytest.approx(130.0, abs=1.0)  # moved with it: one clock


def test_a_resumes_reckoning_is_badput_this_driver_counts():
    """The predecessor's steps past the commit (lost work) and the time no driver ran count in this driver's
    badput counters; what the predecessor booked itself is their base, not an increase."""
    from types import SimpleNamespace

    from monitor.metrics import JobMetrics
    from orchestrator.controller.ledger_snapshot import carry_from_checkpoint

    now = [0.0]
    ledger, metrics = GoodputLedger(clock=lambda: now[0]), JobMetrics("resumed")
    manifest = SimpleNamespace(created_at=1000.0, state={"goodput": {"productive": 1000.0}})
    snapshot = {"time": 1600.0, "totals": {"productive": 1600.0, "startup": 10.0}, "ended": False}
    carry_from_checkpoint(manifest, ledger, [], None, started_at=2500.0, snapshot=snapshot)
    metrics.on_goodput(ledger)

    def badput(cause: str) -> float:
        return metrics.registry.get_sample_value("undying_badput_seconds_total",
                                                 {"undying_job": "resumed", "cause": cause})
    assert (badput("lost_work"), badput("other"), badput("startup")) == (600.0, 900.0, 0.0)


def test_a_checkpoint_saves_the_steps_trained_during_its_background_write_as_lost_work():
    """A successor that restores step 10 redoes the steps finished while its save was written: its
    resume books them lost, so the manifest's ledger holds them in lost_work, not productive."""
    from types import SimpleNamespace

    from orchestrator.controller.ledger_snapshot import saved_goodput

    now = [0.0]
    ledger = GoodputLedger(clock=lambda: now[0])
    ledger.enter("productive")
    now[0] = 100.0
    record = SimpleNamespace(last_step=14, work_seconds=lambda first, end: 2.0 * (end - first))
    saved = saved_goodput(ledger, record, 10)  # steps 10..14 ran past the save of completed step 10
    assert (saved["productive"], saved["lost_work"]) == (90.0, 10.0) and sum(saved.values()) == 100.0
    assert ledger.totals()["productive"] == 100.0  # the live ledger is left as it is
    record = SimpleNamespace(last_step=999, work_seconds=lambda first, end: 1e9)
    assert saved_goodput(ledger, record, 10)["productive"] == 0.0  # clamped to what productive holds


def test_a_first_restore_older_than_the_carried_checkpoint_books_the_work_between_them_as_lost():
    """A rerun carries step 20's ledger, step 20 proves corrupt and step 10 loads: the job's work between
    the two commits is redone, so it is lost work, not productive twice."""
    import time
    from types import SimpleNamespace

    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.controller.ledger_snapshot import LedgerCarry

    ledger = GoodputLedger()
    record = JobRecord("j", 100, JobMetrics("j"), ledger, printer=lambda _: None)
    manifests = {step: SimpleNamespace(created_at=time.time(), state={"goodput": {"productive": 10.0 * step}})
                 for step in (10, 20)}
    carry = LedgerCarry(manifests.__getitem__, ledger, record, None, time.time(), SimpleNamespace(
        skip_before=lambda job_s: None))
    carry.carry(20)
    words = carry.on_restored(10)
    totals = ledger.totals()
    assert totals["productive"] == pytest.approx(100.0) and totals["lost_work"] == pytest.approx(100.0)
    assert "older than step 20" in words and carry.on_restored(10) == ""  # booked once
    carry = LedgerCarry(manifests.__getitem__, GoodputLedger(), record, None, time.time(), SimpleNamespace(
        skip_before=lambda job_s: None))
    carry.carry(20)
    assert carry.on_restored(20) == "" and carry.ledger.totals()["lost_work"] == 0.0


def test_a_fresh_start_after_a_controller_killed_before_its_first_commit_carries_its_time_and_its_faults():
    # Nothing committed, so nothing is restored; the dead controller's snapshot is still the job's time
    # (all its training lost, the time no driver ran `other`), and its timed faults do not fire again.
    import time
    from types import SimpleNamespace

    from monitor.metrics import JobMetrics
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.controller.ledger_snapshot import LedgerCarry

    ledger = GoodputLedger()
    record = JobRecord("j", 100, JobMetrics("j"), ledger, printer=lambda _: None)
    skipped = []
    now = time.time()
    held = {"time": now - 20.0, "totals": {"productive": 30.0, "startup": 10.0}, "ended": False, "failures": []}
    snapshots = SimpleNamespace(held=held)
    carry = LedgerCarry(lambda step: None, ledger, record, snapshots, now, SimpleNamespace(skip_before=skipped.append))
    carry.start_fresh()
    totals = ledger.totals()
    assert totals["lost_work"] == pytest.approx(30.0) and totals["other"] == pytest.approx(20.0, abs=0.5)
    assert totals["productive"] == pytest.approx(0.0, abs=0.5) and snapshots.held is None
    assert skipped == [pytest.approx(60.0, abs=0.5)] and record.job_seconds() == pytest.approx(60.0, abs=1.0)
    carry.start_fresh()  # once per controller run: a later restore of nothing carries nothing more
    assert ledger.totals()["lost_work"] == pytest.approx(30.0) and len(skipped) == 1
    # Not a run that ended on its own (a failed job run again starts over), nor `undying run --fresh`.
    for snapshot, asked in (({**held, "ended": True}, False), (held, True)):
        again = GoodputLedger()
        LedgerCarry(lambda step: None, again, JobRecord("j", 100, JobMetrics("j"), again, printer=lambda _: None),
                    SimpleNamespace(held=snapshot), now, SimpleNamespace(skip_before=skipped.append)).start_fresh(asked)
        assert again.totals()["lost_work"] == 0.0 and len(skipped) == 1
