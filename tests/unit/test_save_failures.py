"""checkpoint.max_failed_saves with the fake worker group: saves that keep failing (chaos write errors
on the manifest, a rank's failed shard writes) fail the job with the storage error once that many
fail in a row; a commit in between resets the count, and what was committed stays intact. A save that
a failure interrupts is counted apart, as skipped."""

from __future__ import annotations

import pytest

from orchestrator.spec.job_spec import SpecError, validate_spec
from tests.unit.test_controller import FakeWorkerGroup
from tests.unit.test_controller import rendezvous as rendezvous  # noqa: F401  (the fixture)
from tests.unit.test_controller_faults import _failed, _run, _skipped, _verified

MANIFEST_WRITES_FAIL = {"kind": "storage_error", "op": "write", "path": "*/manifest.json", "repeat": True}


def test_three_failed_commits_in_a_row_fail_the_job_with_the_storage_error(tmp_path, rendezvous):
    # The manifest writes of steps 20, 30 and 40 fail, the retry too: three saves fail in a row.
    faults = [{**MANIFEST_WRITES_FAIL, "at_step": step} for step in (20, 30, 40)]
    ctl, report, text = _run(tmp_path, rendezvous, faults, steps=60)
    assert report.status == "failed"
    assert report.error.startswith("checkpoint storage failing: 3 consecutive saves failed (steps 20, 30, 40; "
                                   "checkpoint.max_failed_saves=3) and nothing was committed after step 10")
    assert "the last, step 40: the manifest commit failed twice (InjectedStorageError" in report.error
    assert "(1 of checkpoint.max_failed_saves=3 consecutive failures)" in text
    assert "(2 of checkpoint.max_failed_saves=3 consecutive failures)" in text
    assert max(s.step for s in report.losses) < 60  # it stopped, rather than train on to the end
    assert [c.step for c in report.checkpoints] == [10] and (_failed(ctl), _skipped(ctl)) == (3, 0)
    assert _verified(ctl) == [10]


def test_a_commit_between_failed_saves_resets_the_count(tmp_path, rendezvous):
    # Shard writes of 10 and 20 fail, 30 commits, 40 and 50 fail: never 3 in a row, the job ends well.
    ctl, report, text = _run(tmp_path, rendezvous, [], steps=60,
                             fail_shard={10: 0, 20: 1, 40: 0, 50: 1})
    assert report.status == "succeeded", report.error
    assert [c.step for c in report.checkpoints] == [30, 60] and _failed(ctl) == 4
    assert "(2 of checkpoint.max_failed_saves=3 consecutive failures)" in text
    assert _verified(ctl) == [30, 60]


def test_one_failed_save_is_enough_when_the_limit_is_one(tmp_path, rendezvous):
    ctl, report, _ = _run(tmp_path, rendezvous, [], checkpoint_over={"max_failed_saves": 1}, fail_shard={20: 1})
    assert report.status == "failed"
    assert "1 consecutive saves failed (steps 20; checkpoint.max_failed_saves=1)" in report.error
    assert "rank 1 failed to write its shard (InjectedStorageError" in report.error
    assert _verified(ctl) == [10]


@pytest.mark.parametrize("value", [0, -1])
def test_max_failed_saves_below_one_is_refused_naming_the_field(tmp_path, value):
    with pytest.raises(SpecError) as err:
        validate_spec({"name": "unit", "checkpoint": {"url": f"file://{tmp_path}", "max_failed_saves": value}})
    assert "checkpoint.max_failed_saves" in str(err.value) and "greater than or equal to 1" in str(err.value)


def test_a_save_a_failure_interrupts_is_skipped_not_failed(tmp_path, rendezvous, monkeypatch):
    # Only rank 0's shard of step 20 is in when rank 1 dies at step 20: the new generation starts with that
    # save still pending. Nothing failed in it, so it counts as skipped; the redone step 20 commits.
    save_shards, half_done = FakeWorkerGroup.save_shards, {20}

    def rank_0_only_the_first_time(self, store, step, world):
        if step in half_done:
            half_done.discard(step)
            world = 1
        save_shards(self, store, step, world)

    monkeypatch.setattr(FakeWorkerGroup, "save_shards", rank_0_only_the_first_time)
    ctl, report, text = _run(tmp_path, rendezvous, [], die_at={20: 1})
    assert report.status == "succeeded", report.error
    assert [f.rank for f in report.failures] == [1]
    assert [c.step for c in report.checkpoints] == [10, 20, 30]
    assert (_failed(ctl), _skipped(ctl)) == (0, 1)
    assert _verified(ctl) == [20, 30]
