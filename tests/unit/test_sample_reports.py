"""The exactly-once check on what the ranks reported consuming: digests summed per commit,
superseded within a generation, dropped by a restore, compared with the data schedule."""

from orchestrator.cli.chaos.invariants import check_data_once
from orchestrator.controller.step_history import sample_events, surviving_samples
from trainer.batch import SampleDigest
from trainer.config import DataConfig
from trainer.data import DataCursor

GB = 4
CURSOR = DataCursor(DataConfig(), vocab_size=16)


def report(first: int, end: int, dp: int = 2, skip: set | None = None, twice: set | None = None) -> dict:
    """rank -> digest of what each dp replica consumed in steps first..end-1 (rank = replica index)."""
    out = {}
    for r in range(dp):
        digest = SampleDigest()
        for step in range(first, end):
            ids = CURSOR.sample_keys(step, GB, CURSOR.sample_ids(step, GB, r, dp))
            ids = [i for i in ids if i[1] not in (skip or set())] + [i for i in ids if i[1] in (twice or set())]
            digest.add(step, ids)
        out[r] = digest.to_json()
    return out


def generation(first: int, commits: list[int], end: int | None = None, dp: int = 2, **kw) -> list:
    """A generation restored at `first` that ran to `end` (default: its last commit) and committed
    at `commits`, each commit carrying the replicas' cumulative reports since `first`."""
    events = [["steps", first, end or commits[-1], dp]]
    for commit in commits:
        events.extend(sample_events(report(first, commit, dp=dp, **kw)))
    return events


def test_reports_of_a_clean_run_pass_as_reported():
    check = check_data_once(generation(0, [5, 10]), final_step=10, global_batch=GB, cursor=CURSOR)
    assert check.ok and "as the ranks reported them" in check.detail


def test_a_restore_drops_the_reports_it_rolls_back_and_a_new_layout_reports_its_own():
    # commit 8 found corrupt: the next generation restores at 5, with another dp
    events = generation(0, [5, 8], end=9) + [["restore", 5]] + generation(5, [10], dp=1)
    assert [(r.first, r.end) for r in surviving_samples(events)] == [(0, 5), (5, 10)]
    check = check_data_once(events, final_step=10, global_batch=GB, cursor=CURSOR)
    assert check.ok, check.detail


def test_a_sample_consumed_twice_or_skipped_fails_the_check():
    doubled = generation(0, [10], twice={6})  # global sample 6 (step 1, index 2) read twice
    check = check_data_once(doubled, final_step=10, global_batch=GB, cursor=CURSOR)
    assert not check.ok and "steps 0..9: the ranks consumed 41 samples" in check.detail
    replaced = generation(0, [10], skip={6}, twice={7})
    check = check_data_once(replaced, final_step=10, global_batch=GB, cursor=CURSOR)
    assert not check.ok and "consumed 40 samples" in check.detail  # same count, different samples


def test_reports_that_do_not_reach_the_end_fail():
    events = generation(0, [6], end=10)  # steps run to 10, reports only to 6
    check = check_data_once(events, final_step=10, global_batch=GB, cursor=CURSOR)
    assert not check.ok and "reports end at step 6" in check.detail


def test_samples_served_at_another_step_fail_the_check():
    """A cursor that serves step 2's samples at step 3 and step 3's at step 2 consumes every sample once,
    in another order: the digest holds each sample's step, so the check sees it."""
    swapped = {2: 3, 3: 2}
    digest = SampleDigest()
    for step in range(10):
        digest.add(step, CURSOR.sample_keys(swapped.get(step, step), GB))
    want = SampleDigest.of(0, [CURSOR.sample_keys(step, GB) for step in range(10)])
    assert digest.count == want.count and digest.total != want.total
    events = [["steps", 0, 10, 1], *sample_events({0: digest.to_json()})]
    assert not check_data_once(events, final_step=10, global_batch=GB, cursor=CURSOR).ok
