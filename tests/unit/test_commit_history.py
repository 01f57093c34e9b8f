"""The committer against the history a restore left: a job that resumed from an older step than
the newest committed one (it skipped that one: unreadable then, not proven bad) keeps its own
commits through retention, leaves the skipped steps as they are, and skips (does not fail) a save
that reaches one of their step numbers; a store's connection error that is no OSError fails a save,
never the controller."""

from __future__ import annotations

import pytest
import torch

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.manifest import step_dir
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from tests._checkpoints import feed, flip_bit, make_state, save_checkpoint, shard_of, shard_receipts


@pytest.fixture
def catalog(tmp_path) -> Catalog:
    return Catalog(Storage(f"file://{tmp_path}/ckpt/job"))


class _Plans:
    def set_plan(self, data: dict) -> None:
        pass


def _controller_checkpoints(tmp_path, name: str, steps: int, keep: int):
    """The controller's Checkpoints of a 2-rank job `name` training `steps` steps (a save every 50,
    `keep` kept), with its catalog, its log lines and its ledger and record."""
    from monitor.goodput import GoodputLedger
    from monitor.metrics import JobMetrics
    from orchestrator.controller.checkpoints import Checkpoints
    from orchestrator.controller.faults import ControllerFaults
    from orchestrator.controller.job_record import JobRecord
    from orchestrator.spec.job_spec import validate_spec

    spec = validate_spec({"name": name, "model": {"preset": "tiny"}, "data": {"seq_len": 16},
                          "train": {"steps": steps, "global_batch": 4, "micro_batch": 1}, "parallel": {"dp": 2},
                          "checkpoint": {"url": f"file://{tmp_path}/ckpt", "every_steps": 50, "keep": keep}})
    ledger, metrics, lines = GoodputLedger(), JobMetrics(name), []
    record = JobRecord(spec.name, spec.train.steps, metrics, ledger)
    catalog = Catalog(Storage(spec.checkpoint_root))
    checkpoints = Checkpoints(spec, catalog, ledger, record, metrics,
                              ControllerFaults([], catalog, 0, ledger.wall, printer=lambda line: None),
                              log=lines.append)
    return spec, catalog, checkpoints, lines, ledger, record


def test_retention_counts_only_the_history_the_job_resumed(catalog):
    # Steps 100 and 200 are committed; this run skipped 200 (a rank could not read it; not proven
    # bad) and resumed from 100. Its commit of 150 must survive keep=1, and so must 200.
    for step in (100, 200):
        save_checkpoint(catalog, step, make_state(step))
    committer = Committer(catalog, "j", "h", keep=1)
    committer.reset(100, left_behind={200})
    assert feed(committer, shard_receipts(catalog, 150, make_state(150), tag="r2g1")).step == 150
    assert catalog.committed_steps() == [150, 200]
    torch.testing.assert_close(load_checkpoint(catalog, 150)[0]["model/w"], make_state(150)["model/w"])


def test_a_save_at_a_step_the_restore_left_behind_is_skipped_kept_and_not_failed(catalog):
    for step in (10, 30):
        save_checkpoint(catalog, step, make_state(step))
    dropped, skipped = [], []
    committer = Committer(catalog, "j", "h", keep=3, on_dropped=lambda s, why: dropped.append(s))
    committer.on_skipped = lambda s, why: skipped.append((s, why))
    committer.reset(10, left_behind={30})
    assert feed(committer, shard_receipts(catalog, 30, make_state(99), tag="r2g1")) is None
    assert dropped == [] and skipped[0][0] == 30 and "committed already" in skipped[0][1]
    torch.testing.assert_close(load_checkpoint(catalog, 30)[0]["model/w"], make_state(30)["model/w"])  # kept as it was
    assert feed(committer, shard_receipts(catalog, 40, make_state(40), tag="r2g1")).step == 40
    # A collision at a step nobody skipped is a failed save, as before.
    committer.reset(40)
    assert feed(committer, shard_receipts(catalog, 50, make_state(50), tag="r2g2")).step == 50
    committer.reset(10)
    assert feed(committer, shard_receipts(catalog, 40, make_state(41), tag="r2g3")) is None and dropped == [40]


def test_a_save_at_a_skipped_step_whose_manifest_is_corrupt_quarantines_it_as_evidence(catalog):
    # Step 30's committed manifest does not parse (bit rot); the restore skipped it and could not
    # move it aside. This run's save of step 30 finds it: it goes aside as corrupt (kept as evidence,
    # counted by quarantined_steps), not as a torn write of ours, and the fresh save commits.
    for step in (10, 30):
        save_checkpoint(catalog, step, make_state(step))
    catalog.storage.fs.pipe_file(catalog.manifest_path(30), b"{not a manifest")
    catalog.storage.invalidate()
    committer = Committer(catalog, "j", "h", keep=3)
    committer.reset(10, left_behind={30})
    assert feed(committer, shard_receipts(catalog, 30, make_state(31), tag="r2g1")).step == 30
    names = catalog.storage.listdir(catalog.storage.path(step_dir(30)))
    assert any(n.startswith("manifest.corrupt-") for n in names) and not any("torn" in n for n in names)
    torch.testing.assert_close(load_checkpoint(catalog, 30)[0]["model/w"], make_state(31)["model/w"])


class _FlakyManifestReads(Storage):
    """Once `garble(first)`: creates of step 30's manifest time out, and the next read of it returns
    `first` (garbled bytes, as a reply damaged on the wire) where the stored bytes are good."""

    first: bytes | None = None

    def garble(self, first: bytes) -> None:
        self.first = first

    def create_exclusive(self, path: str, data: bytes) -> None:
        if path.endswith(f"{step_dir(30)}/manifest.json") and self.first is not None:
            raise ConnectionResetError("the PUT of the manifest timed out")
        super().create_exclusive(path, data)

    def read(self, path: str) -> bytes:
        if path.endswith(f"{step_dir(30)}/manifest.json") and self.first is not None:
            first, self.first = self.first, None
            return first
        return super().read(path)


def test_a_committed_manifest_that_reads_garbled_once_after_a_failed_create_stays_committed(tmp_path):
    # Step 30 was committed by the history the restore left; this run's save of 30 fails its create
    # (a timeout) and the check that follows reads the kept manifest garbled once. One bad read is no
    # proof: the manifest reads whole the second time and stays, with its checkpoint.
    catalog = Catalog(_FlakyManifestReads(f"file://{tmp_path}/ckpt/job"))
    for step in (10, 30):
        save_checkpoint(catalog, step, make_state(step))
    catalog.storage.garble(b'{"step": 30, "tens')
    committer = Committer(catalog, "j", "h", keep=3)
    committer.reset(10, left_behind={30})
    assert feed(committer, shard_receipts(catalog, 30, make_state(99), tag="r2g1")) is None  # not committed
    assert catalog.committed_steps() == [10, 30] and catalog.quarantined_steps() == []
    torch.testing.assert_close(load_checkpoint(catalog, 30)[0]["model/w"], make_state(30)["model/w"])


def test_a_commit_meeting_a_connection_error_that_is_no_oserror_is_a_failed_save_not_a_crash(catalog, caplog):
    botocore = pytest.importorskip("botocore.exceptions")
    dropped = []
    committer = Committer(catalog, "j", "h", keep=3, on_dropped=lambda s, why: dropped.append((s, why)))
    real = catalog.storage.create_exclusive

    def create_exclusive(path, data):
        raise botocore.EndpointConnectionError(endpoint_url="http://s3:9000")

    catalog.storage.create_exclusive = create_exclusive
    assert feed(committer, shard_receipts(catalog, 20, make_state(20))) is None
    assert dropped and dropped[0][0] == 20 and "EndpointConnectionError" in dropped[0][1]
    catalog.storage.create_exclusive = real
    assert feed(committer, shard_receipts(catalog, 30, make_state(30), tag="retry")).step == 30


def test_a_skipped_step_the_job_has_passed_is_neither_counted_nor_deleted(catalog):
    # Resumed at 300 past a skipped 500; with keep=2 the job's 400 and 600 are its two newest.
    for step in (300, 500):
        save_checkpoint(catalog, step, make_state(step))
    committer = Committer(catalog, "j", "h", keep=2)
    committer.reset(300, left_behind={500})
    for step in (400, 600):
        assert feed(committer, shard_receipts(catalog, step, make_state(step), tag="r2g1")).step == step
    assert catalog.committed_steps() == [400, 500, 600]


def test_the_controller_hands_the_steps_its_restore_skipped_to_the_committer(tmp_path):
    spec, catalog, checkpoints, lines, _, _ = _controller_checkpoints(tmp_path, "left", steps=300, keep=1)
    for step in (100, 200):
        save_checkpoint(catalog, step, make_state(step))
    checkpoints.restore.bad[200] = "unreadable to rank 1 (not proven bad)"

    checkpoints.begin(_Plans(), 1, 100)
    assert checkpoints.committer.left_behind == {200}
    assert feed(checkpoints.committer, shard_receipts(catalog, 200, make_state(7), tag="r1g1")) is None
    assert catalog.committed_steps() == [100, 200] and checkpoints.failures.run.steps == []
    assert "checkpoint step 200 is not committed: step 200 is committed already" in lines[-1]


def test_a_job_that_trains_again_to_its_final_step_kept_intact_from_before_succeeds(tmp_path):
    """The final step 200 is committed; a rank read it damaged, the controller's verification read it
    intact, so it stays committed and the job resumed from 100. Training to 200 again, the save is
    skipped (the step is kept as it is): the job has its final checkpoint and succeeds. A step not
    verified whole yet is verified then; one that does not verify fails the job naming the step."""
    from types import SimpleNamespace

    from ckpt.errors import CorruptCheckpoint
    from orchestrator.controller.states import State, Succeeded
    from orchestrator.controller.stopping import Stops
    from orchestrator.spec.job_spec import spec_hash

    spec, catalog, checkpoints, lines, ledger, record = _controller_checkpoints(tmp_path, "final", steps=200, keep=2)
    for step in (100, 200):  # an earlier run of this spec
        catalog.commit(job=spec.name, step=step, generation=0, layout={"dp": 2, "tp": 1, "pp": 1, "zero": 0},
                       spec_hash=spec_hash(spec), receipts=shard_receipts(catalog, step, make_state(step), tag="old"),
                       state={"engine": {"next_step": step}})
    assert "it verifies here" in checkpoints.on_unloadable(200, None, CorruptCheckpoint("crc mismatch on rank 1"))
    assert checkpoints.restore_point() == 100

    checkpoints.begin(_Plans(), 1, 100)
    assert feed(checkpoints.committer, shard_receipts(catalog, 150, make_state(150), tag="r1g1")).step == 150
    assert feed(checkpoints.committer, shard_receipts(catalog, 200, make_state(7), tag="r1g1")) is None
    now = [0.0]
    stops = Stops(spec, None, checkpoints, record, ledger, None, None, dict, lines.append, clock=lambda: now[0])
    running = SimpleNamespace(state=State.RUNNING, run=object())
    assert stops.finished(running, None, 1, 2, 2) is None  # the last receipts may still be on their way
    now[0] = 2.0
    move = stops.finished(running, None, 1, 2, 2)
    assert isinstance(move.phase, Succeeded), move
    assert "final checkpoint is step 200 as committed before" in move.sentence
    torch.testing.assert_close(load_checkpoint(catalog, 200)[0]["model/w"], make_state(200)["model/w"])

    checkpoints.committer.spec_hash = "another"  # a run of another spec must not take it as its own
    move = stops.finished(running, None, 1, 2, 2)
    assert not isinstance(move.phase, Succeeded) and "committed by a run of another spec" in lines[-1]
    checkpoints.committer.spec_hash = spec_hash(spec)
    checkpoints.restore.intact.clear()  # not verified whole yet: it is now, and a damaged one fails the job
    flip_bit(catalog, 200, shard_of(catalog, 200, "model/w"))
    move = stops.finished(running, None, 1, 2, 2)
    assert not isinstance(move.phase, Succeeded) and "final checkpoint (step 200) was not committed" in move.sentence


def test_a_final_receipt_that_lands_just_after_every_rank_returned_still_ends_the_job_succeeded(tmp_path):
    # The ranks return once their last save is durable; its receipt was queued to the store before,
    # unacknowledged, and may be read a poll later: the job must not fail for that.
    from types import SimpleNamespace

    from orchestrator.controller.states import State, Succeeded
    from orchestrator.controller.stopping import RECEIPTS_S, Stops

    spec, catalog, checkpoints, lines, ledger, record = _controller_checkpoints(tmp_path, "late", steps=100, keep=2)
    checkpoints.begin(_Plans(), 0, None)
    now = [0.0]
    stops = Stops(spec, None, checkpoints, record, ledger, None, None, dict, lines.append, clock=lambda: now[0])
    running = SimpleNamespace(state=State.RUNNING, run=object())
    assert stops.finished(running, None, 0, 2, 2) is None  # step 100 not committed yet: its receipts may come
    now[0] = RECEIPTS_S / 2
    assert feed(checkpoints.committer, shard_receipts(catalog, 100, make_state(100), tag="r1g0")).step == 100
    move = stops.finished(running, None, 0, 2, 2)
    assert isinstance(move.phase, Succeeded) and "final checkpoint committed" in move.sentence


def test_a_restore_stops_a_retention_pass_that_would_delete_the_commit_it_may_fall_back_to(tmp_path, monkeypatch):
    import threading

    _, catalog, checkpoints, _, _, _ = _controller_checkpoints(tmp_path, "fallback", steps=300, keep=1)
    checkpoints.begin(_Plans(), 1, None)
    assert feed(checkpoints.committer, shard_receipts(catalog, 100, make_state(100), tag="r1g1")).step == 100
    assert checkpoints.committer.settle(5)
    listing, release, real_listdir = threading.Event(), threading.Event(), Storage.listdir

    def slow_listdir(self, path):  # retention's listing of the root hangs (a throttling store)
        if path.rstrip("/") == catalog.storage.root and threading.current_thread().name == "undying-ckpt-retention":
            listing.set()
            assert release.wait(10)
        return real_listdir(self, path)

    monkeypatch.setattr(Storage, "listdir", slow_listdir)
    assert feed(checkpoints.committer, shard_receipts(catalog, 200, make_state(200), tag="r1g1")).step == 200
    assert listing.wait(5)  # its pass (keep=1) is about to delete step 100
    threading.Timer(0.3, release.set).start()  # the store answers while the restore waits for the pass
    assert checkpoints.restore_point() == 200
    assert catalog.committed_steps() == [100, 200]  # stopped before deleting: a fallback would find 100 whole


def test_a_signal_gives_up_a_restore_retrying_a_failing_store_instead_of_outliving_the_grace(tmp_path):
    import errno
    import threading
    import time

    from orchestrator.cluster.interruptible import Interrupted

    _, catalog, checkpoints, _, _, _ = _controller_checkpoints(tmp_path, "brownout", steps=300, keep=2)
    calls = []

    def failing_listing():  # a storage brownout: every listing fails for read_retry_s (120 s)
        calls.append(time.monotonic())
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    catalog.committed_steps = failing_listing
    signalled = []
    checkpoints.interrupted = lambda: bool(signalled)
    began = time.monotonic()
    threading.Timer(0.5, lambda: signalled.append(True)).start()
    with pytest.raises(Interrupted, match="the restore's reads are given up"):
        checkpoints.restore_point()
    assert time.monotonic() - began < 3.0 and len(calls) >= 2  # retried until the signal, not 120 s
