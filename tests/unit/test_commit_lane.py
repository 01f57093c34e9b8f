"""Manifest creates off the controller's thread (ckpt.commit's lane): the controller goes on while
a slow or hung store holds a create, settles what it came to at its next drain, and waits for it
only where the step it lands at matters (a restore's choice, a stop, the job's last save)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.housekeeping import Housekeeper
from ckpt.manifest import MANIFEST_NAME, step_dir
from ckpt.ownership import OwnershipLost
from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.controller.machine import Controller
from tests._checkpoints import feed, shard_receipts
from tests.unit.test_controller import FakeWorkerGroup, _spec
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)


class _HeldCreates(Storage):
    """A store whose manifest creates of the steps in `hold` wait until `release(step)` (a hung
    request), at most `limit_s`; `creating` is set while one waits."""

    def __init__(self, url: str, hold=(), limit_s: float = 10.0):
        super().__init__(url)
        self.hold, self.limit_s = {s: threading.Event() for s in hold}, limit_s
        self.creating = threading.Event()
        self.on_hold = lambda step: None  # called on the create's thread while it waits

    def create_exclusive(self, path: str, data: bytes) -> None:
        step = next((s for s in self.hold if path.endswith(f"{step_dir(s)}/{MANIFEST_NAME}")), None)
        if step is not None:
            self.creating.set()
            self.on_hold(step)
            self.hold[step].wait(self.limit_s)
        super().create_exclusive(path, data)

    def release(self, step: int) -> None:
        self.hold[step].set()


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"model/w": torch.full((4, 4), float(step)), "model/b": torch.arange(4.0) + step}


def _hand(committer: Committer, catalog: Catalog, step: int) -> None:
    """Every receipt of a save of `step`, without waiting for its commit."""
    receipts = shard_receipts(catalog, step, _state(step))
    for r in receipts:
        extra = {"engine": {"next_step": step}} if r.rank == 0 else {}
        assert committer.on_receipt(r, extra, len(receipts), 1, {}, lambda samples: {}) is None


def _held(tmp_path, step: int, **committer) -> tuple[_HeldCreates, Catalog, Committer, list[int]]:
    """A committer with a commit lane over a store holding step `step`'s create: (store, catalog,
    committer, the steps it reported skipped)."""
    storage = _HeldCreates(f"file://{tmp_path}/ckpt/job", hold=[step])
    catalog, skipped = Catalog(storage), []
    committer = Committer(catalog, "j", "h", lane=Housekeeper("test-commit"), **{"keep": 3, **committer})
    committer.on_skipped = lambda step, reason: skipped.append(step)
    return storage, catalog, committer, skipped


def test_a_complete_save_is_handed_over_and_committed_at_the_next_collect(tmp_path):
    storage, catalog, committer, _ = _held(tmp_path, 10)
    _hand(committer, catalog, 10)  # returns at once although the store holds the create
    assert storage.creating.wait(5)
    assert list(committer.unsettled) == [10] and committer.committing and committer.latest is None
    assert committer.collect() == [] and not committer.flush(0.05)
    storage.release(10)
    assert committer.flush(5)
    [commit] = committer.collect()
    assert commit.step == committer.latest == 10 and not committer.unsettled
    assert catalog.committed_steps() == [10]


def test_a_save_queued_behind_a_held_create_is_replaced_by_a_newer_one_and_reported_skipped(tmp_path):
    storage, catalog, committer, skipped = _held(tmp_path, 10)
    _hand(committer, catalog, 10)
    assert storage.creating.wait(5)
    _hand(committer, catalog, 20)  # queued behind step 10's create...
    _hand(committer, catalog, 30)  # ...and replaced: step 30's commit makes it moot
    assert skipped == [20] and sorted(committer.committing) == [10, 30]  # said at once, not when the lane idles
    storage.release(10)
    assert committer.flush(5)
    assert [c.step for c in committer.collect()] == [10, 30]
    assert skipped == [20] and not committer.unsettled
    assert catalog.committed_steps() == [10, 30]


def test_an_older_save_completing_behind_a_newer_create_is_dropped(tmp_path):
    storage, catalog, committer, skipped = _held(tmp_path, 20)
    _hand(committer, catalog, 20)
    assert storage.creating.wait(5)
    _hand(committer, catalog, 10)  # its last receipt came late: step 20 overtook it
    assert skipped == [10]
    storage.release(20)
    assert committer.flush(5) and [c.step for c in committer.collect()] == [20]
    assert catalog.committed_steps() == [20]


def test_a_late_shard_error_of_a_save_whose_create_is_under_way_is_not_a_failed_save(tmp_path):
    dropped: list[int] = []
    storage, catalog, committer, _ = _held(tmp_path, 10, on_dropped=lambda step, reason: dropped.append(step))
    _hand(committer, catalog, 10)
    assert storage.creating.wait(5)
    committer.abandon(10, "rank 1's receipt push failed after it was queued")  # every receipt is in: moot
    storage.release(10)
    assert committer.flush(5) and [c.step for c in committer.collect()] == [10] and dropped == []


def _refuse(catalog: Catalog, step: int) -> None:
    """The store refuses every manifest create of `step` (a 503); the other steps' commit as ever."""
    real_commit = catalog.commit

    def commit(**kwargs):
        if kwargs["step"] == step:
            raise OSError("503 Slow Down")
        return real_commit(**kwargs)

    catalog.commit = commit


def _step_10_refused_then_20_committed(tmp_path, error: type[Exception]) -> Committer:
    """A lane whose create of step 10 is refused twice, reported to an `on_dropped` that raises `error`
    (SaveFailures at checkpoint.max_failed_saves), and whose create of step 20 lands; both settled."""
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))

    def limit(step, reason):
        raise error(f"limit at {step}")

    committer = Committer(catalog, "j", "h", keep=3, lane=Housekeeper("test-commit"), on_dropped=limit)
    _refuse(catalog, 10)
    _hand(committer, catalog, 10)
    _hand(committer, catalog, 20)
    assert committer.flush(5)
    return committer


def test_every_finished_create_is_settled_before_the_first_error_among_them_is_raised(tmp_path):
    committer = _step_10_refused_then_20_committed(tmp_path, RuntimeError)  # (an error of any other kind)
    with pytest.raises(RuntimeError, match="limit at 10"):
        committer.collect()
    assert committer.latest == 20 and not committer.committing  # step 20 was booked all the same


def test_the_lanes_errors_and_failed_saves_are_acted_on_by_the_collecting_thread(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    dropped: list[tuple[int, str]] = []
    committer = Committer(catalog, "j", "h", keep=2, lane=Housekeeper("test-commit"),
                          on_dropped=lambda step, reason: dropped.append((step, threading.current_thread().name)))

    def refused(**kwargs):
        raise OSError("503 Slow Down")

    catalog.commit = refused
    _hand(committer, catalog, 10)
    assert committer.flush(5) and dropped == []  # nothing acted on off the collecting thread
    assert committer.collect() == []
    assert dropped == [(10, threading.current_thread().name)] and "503 Slow Down" in committer.rejected[10]

    def claimed(**kwargs):
        raise OwnershipLost("another driver claimed the root")

    catalog.commit = claimed
    _hand(committer, catalog, 20)
    assert committer.flush(5)
    with pytest.raises(OwnershipLost, match="another driver"):
        committer.collect()  # raised where an inline commit raises it: the controller ends the job


def test_feed_through_a_lane_commits_as_inline(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    lane = Committer(catalog, "j", "h", keep=1, lane=Housekeeper("test-commit"))
    assert feed(lane, shard_receipts(catalog, 10, _state(10))).step == 10
    assert feed(lane, shard_receipts(catalog, 20, _state(20))).step == 20
    assert catalog.committed_steps() == [20]


def _run(spec, storage, rendezvous, lines, **fake):
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root), **fake)
    workers.step_sleep = 0.02  # the ranks train on while a create is held
    ctl = Controller(spec, workers, rendezvous, Catalog(storage), JobMetrics(spec.name), printer=lines.append,
                     poll_s=0.001, release_timeout_s=0.5)
    return ctl.run()


def test_a_rank_dying_while_the_store_holds_a_manifest_create_is_noticed_and_the_restore_waits_for_it(
        tmp_path, rendezvous):
    spec = _spec(tmp_path)
    storage = _HeldCreates(spec.checkpoint_root, hold=[10])
    lines: list[str] = []
    noticed: list[bool] = []

    def hold(step):  # the store answers once the controller noticed rank 1's death at step 15, or in 5 s
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("-> RECOVERING" in line for line in lines):
            time.sleep(0.01)
        noticed.append(any("-> RECOVERING" in line for line in lines))
        storage.release(step)

    storage.on_hold = hold
    report = _run(spec, storage, rendezvous, lines, die_at={15: 1})
    assert report.status == "succeeded" and report.final_step == 30, report.error
    assert noticed == [True], "\n".join(lines)  # the controller went on while the create was held
    text = "\n".join(lines)
    # The recovery waited for the create: it booked and restored the step that landed, not a fresh start.
    assert "work after step 10 to redo" in text and "restored step 10" in text, text
    assert [c.step for c in report.checkpoints] == [10, 20, 30]


def test_the_last_save_held_by_the_store_past_the_receipts_wait_still_ends_the_job_committed(tmp_path, rendezvous):
    spec = _spec(tmp_path)
    storage = _HeldCreates(spec.checkpoint_root, hold=[30])
    storage.on_hold = lambda step: time.sleep(1.5)  # longer than the wait for late receipts (1 s)
    storage.release(30)
    lines: list[str] = []
    report = _run(spec, storage, rendezvous, lines)
    assert report.status == "succeeded" and report.final_step == 30, report.error
    assert any("final checkpoint committed" in line for line in lines), lines


def test_the_runs_end_gives_a_held_create_and_a_held_retention_pass_one_wait_together(tmp_path, monkeypatch):
    # A preemption's grace is short: the run's end waits SETTLE_S for both, not SETTLE_S for each.
    from orchestrator.controller import checkpoints as module
    from tests.unit.test_commit_history import _controller_checkpoints

    monkeypatch.setattr(module, "SETTLE_S", 1.0)
    _, _, checkpoints, lines, _, _ = _controller_checkpoints(tmp_path, "ends", steps=30, keep=2)
    release = threading.Event()
    for thread in (checkpoints.committer.lane, checkpoints.committer.housekeeper):
        thread.submit(lambda: release.wait(10))
    began = time.monotonic()
    checkpoints.close()
    waited = time.monotonic() - began
    release.set()
    assert waited < 1.8, waited  # one second in all (two, waited one after the other)
    assert [line.split(" still running")[0] for line in lines if "still running" in line] == [
        "manifest commit", "checkpoint retention"]


def test_a_late_shard_error_of_a_save_already_dropped_or_skipped_counts_nothing_more(tmp_path):
    catalog = Catalog(Storage(f"file://{tmp_path}/ckpt/job"))
    dropped: list[int] = []
    committer = Committer(catalog, "j", "h", keep=3, lane=Housekeeper("test-commit"),
                          on_dropped=lambda step, reason: dropped.append(step))
    real_commit = catalog.commit

    def refused(**kwargs):
        raise OSError("503 Slow Down")

    catalog.commit = refused
    _hand(committer, catalog, 10)  # both creates refused: the save dropped
    assert committer.flush(5) and committer.collect() == [] and dropped == [10]
    committer.abandon(10, "rank 1's receipt push failed after it was queued")  # the same failed save
    assert dropped == [10]
    catalog.commit = real_commit
    _hand(committer, catalog, 20)
    assert committer.flush(5) and [c.step for c in committer.collect()] == [20]
    committer.reset(None)  # a new generation, restored from before step 10, may save it again: counted then
    committer.abandon(10, "rank 0 could not write its shard")
    assert dropped == [10, 10]


def test_a_signal_while_the_final_commit_is_held_ends_the_job_within_the_grace(tmp_path, rendezvous):
    import signal

    spec = _spec(tmp_path, elastic={"max_restarts": 1, "preemption_grace_s": 1.0})
    storage = _HeldCreates(spec.checkpoint_root, hold=[30], limit_s=8.0)
    workers = FakeWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    lines: list[str] = []
    ctl = Controller(spec, workers, rendezvous, Catalog(storage), JobMetrics(spec.name), printer=lines.append,
                     poll_s=0.001, release_timeout_s=0.5)
    signalled: list[float] = []
    storage.on_hold = lambda step: (signalled.append(time.monotonic()), ctl.stops.on_signal(signal.SIGTERM))
    report = ctl.run()
    ended = time.monotonic()
    storage.release(30)
    assert report.status == "preempted" and "as the final checkpoint (step 30) was being committed" in report.error
    # Within the grace, and the run's end within its floor (END_FLOOR_S) for each store write left.
    assert ended - signalled[0] < 1.0 + 2 * 1.0 + 1.0, ended - signalled[0]


def test_saves_replaced_behind_a_create_unanswered_past_its_limit_count_as_failed(tmp_path):
    # A hung create must not turn every later save into a "skipped" one: nothing would ever commit and
    # checkpoint.max_failed_saves would never end the job.
    dropped: list[int] = []
    storage, catalog, committer, skipped = _held(tmp_path, 10, create_limit_s=2.0,
                                                 on_dropped=lambda step, reason: dropped.append((step, reason)))
    _hand(committer, catalog, 10)
    assert storage.creating.wait(5)
    _hand(committer, catalog, 20)
    _hand(committer, catalog, 30)  # step 20 replaced while step 10's create is young: skipped
    assert skipped == [20] and committer.overdue() is None
    time.sleep(2.1)
    _hand(committer, catalog, 40)  # step 30 replaced with step 10's create past its limit: failed
    _hand(committer, catalog, 5)  # an older save completing behind it: failed too
    assert skipped == [20] and [step for step, _ in dropped] == [30, 5]
    assert all("create of step 10 has not returned" in reason and "commit_timeout_s=2" in reason
               for _, reason in dropped)
    storage.release(10)
    assert committer.flush(5) and [c.step for c in committer.collect()] == [10, 40]
    assert committer.overdue() is None


def test_a_run_of_failed_saves_that_a_newer_commit_of_the_same_batch_ended_does_not_end_the_job(tmp_path):
    from ckpt.failed_saves import SavesFailing

    committer = _step_10_refused_then_20_committed(tmp_path, SavesFailing)
    booked: list[int] = []
    assert committer.collect(lambda c: booked.append(c.step) or c.step) == [20]  # the store took step 20
    assert booked == [20] and committer.latest == 20


def test_a_recovery_waiting_on_a_create_past_its_limit_ends_the_job_naming_the_step(tmp_path):
    from ckpt.failed_saves import SavesFailing
    from tests.unit.test_commit_history import _controller_checkpoints

    _, _, checkpoints, lines, _, _ = _controller_checkpoints(tmp_path, "hung", steps=30, keep=2)
    release = threading.Event()
    committer = checkpoints.committer
    committer.create_limit_s = 0.3
    committer.committing[10] = object()

    def hung():
        with committer._attempts_lock:
            committer._creating = (10, time.monotonic())
        release.wait(10)

    committer.lane.submit(hung)
    began = time.monotonic()
    with pytest.raises(SavesFailing, match=r"create of step 10 has not returned .*commit_timeout_s=0.3"):
        checkpoints.flush()
    assert time.monotonic() - began < 5
    release.set()


def test_the_jobs_last_save_held_past_its_create_limit_fails_the_job_rather_than_wait_forever(tmp_path, rendezvous):
    spec = _spec(tmp_path, checkpoint={"url": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 2,
                                       "commit_timeout_s": 0.5})
    storage = _HeldCreates(spec.checkpoint_root, hold=[30], limit_s=20)
    lines: list[str] = []
    began = time.monotonic()
    report = _run(spec, storage, rendezvous, lines)
    storage.release(30)
    assert report.status == "failed" and "create of step 30 has not returned" in report.error, report.error
    assert time.monotonic() - began < 15
    assert [c.step for c in report.checkpoints] == [10, 20]


def test_a_failed_save_after_a_commit_of_the_same_batch_counts_from_that_commit(tmp_path):
    # Saves 100 and 200 failed (max_failed_saves=3); a recovery's flush then settles 300 (committed) and
    # 400 (failed) together: 400 is the first failure after a commit, not the third in a row.
    from ckpt.failed_saves import FailedSaves

    run = FailedSaves(3)
    storage, catalog, committer, _ = _held(tmp_path, 300, on_dropped=lambda step, reason: run.failed(step, reason))
    run.failed(100, "refused")
    run.failed(200, "refused")
    _refuse(catalog, 400)
    _hand(committer, catalog, 300)
    assert storage.creating.wait(5)  # 300's create under way: 400 queues behind it
    _hand(committer, catalog, 400)
    storage.release(300)
    assert committer.flush(5)
    assert committer.collect(lambda c: (run.committed(), c.step)[1]) == [300]  # no SavesFailing
    assert run.steps == [400]
