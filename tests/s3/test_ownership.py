"""The owner lease on a checkpoint root (ckpt.ownership), on a local folder and on a real S3 server:
who may claim it when, how fast a dead owner is replaced, and that a replaced owner changes
nothing more. (Not memory://, whose create is check-then-write within one process.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ckpt import process_identity
from ckpt.catalog import Catalog, GcPlan
from ckpt.owner_claims import OWNER_DIR, STALE_FLOOR_S, epochs, live_owner, newest_claim
from ckpt.ownership import (
    KEEP_CLAIMS,
    OwnerAlive,
    OwnerLease,
    OwnershipLost,
    OwnershipUncertain,
    refuse_a_beating_owner,
)
from ckpt.storage import Storage
from tests._checkpoints import make_state, save_checkpoint

LEASE_S = 1.2  # a beat every 0.2 s


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request, tmp_path):
    if request.param == "file":
        return Storage(f"file://{tmp_path}/job")
    backend = request.getfixturevalue("s3_backend")
    return Storage(backend.url, backend.storage_options)


def _foreign_claim(storage: Storage, epoch: int, beat_age_s: float = 0.0) -> None:
    """A claim written by a process on another host, with one beat `beat_age_s` old."""
    record = {"holder": "undying run of job 'elsewhere'", "lease_s": LEASE_S, "claimed_at": time.time(),
              "process": {"host": "node-7/boot/pid:[1]", "pid": 4242, "started": "1"}}
    storage.create_exclusive(storage.path(OWNER_DIR, f"claim-{epoch:010d}.json"), json.dumps(record).encode())
    _foreign_beat(storage, epoch, 1, time.time() - beat_age_s)


def _foreign_beat(storage: Storage, epoch: int, n: int, at: float) -> None:
    beat = {"beat": n, "time": at, "ended": False}
    storage.write_immutable(storage.path(OWNER_DIR, f"beat-{epoch:010d}.json"), json.dumps(beat).encode())


def test_a_held_root_is_refused_while_its_owner_beats_and_taken_at_once_once_released(storage):
    first = OwnerLease.claim(storage, "first", LEASE_S)
    assert first.epoch == 0 and epochs(storage) == [0]
    beats = newest_claim(storage).beat["beat"]
    time.sleep(3 * LEASE_S / 6)
    assert newest_claim(storage).beat["beat"] > beats  # the heartbeat thread renews it
    started = time.monotonic()
    with pytest.raises(OwnerAlive, match=f"held by first on host .*, pid {os.getpid()}, whose heartbeat advanced"):
        OwnerLease.claim(storage, "second", LEASE_S)
    assert time.monotonic() - started < LEASE_S  # refused as soon as a beat advanced
    assert epochs(storage) == [0]  # nothing written
    assert live_owner(storage).startswith("first on host")
    first.release()
    assert live_owner(storage) is None
    started = time.monotonic()
    second = OwnerLease.claim(storage, "second", LEASE_S)
    assert time.monotonic() - started < LEASE_S / 2 and second.epoch == 1
    assert "released it" in newest_claim(storage).record["taken_because"]
    second.release()


def test_an_owner_killed_on_this_host_is_replaced_at_once(storage):
    child = subprocess.Popen(
        [sys.executable, "-c", "import json, sys, time\nfrom ckpt.storage import Storage\nfrom ckpt.ownership import "
         "OwnerLease\nOwnerLease.claim(Storage(sys.argv[1], json.loads(sys.argv[2])), 'child', 60.0)\n"
         "print('claimed', flush=True)\ntime.sleep(600)", storage.url, json.dumps(storage.storage_options)],
        stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert child.stdout.readline().strip() == "claimed"
        assert live_owner(storage) is not None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert newest_claim(storage).record["process"]["pid"] == child.pid
    started = time.monotonic()
    lease = OwnerLease.claim(storage, "rerun", 60.0)  # a 60 s lease, yet no wait
    assert time.monotonic() - started < 5.0 and lease.epoch == 1
    assert "is no longer running" in newest_claim(storage).record["taken_because"]
    lease.release()


def test_process_identity_tells_a_reused_pid_from_its_first_process():
    me = process_identity.this_process()
    assert not process_identity.gone(me)
    assert process_identity.gone({**me, "started": "1"})  # this PID, started at another time: reused
    assert not process_identity.gone({**me, "host": "elsewhere"})  # another host: not known


def test_a_silent_owner_elsewhere_is_watched_for_a_lease_and_a_beating_one_refused(storage):
    _foreign_claim(storage, 0)
    said = []
    started = time.monotonic()
    lease = OwnerLease.claim(storage, "here", LEASE_S, say=said.append)
    waited = time.monotonic() - started
    assert LEASE_S * 7 / 6 <= waited < LEASE_S * 7 / 6 + 1.0 and lease.epoch == 1
    assert "watching its heartbeat" in said[0] and "node-7" in said[0]
    assert "sent no heartbeat" in newest_claim(storage).record["taken_because"]
    lease.release()

    _foreign_claim(storage, 2)
    stop = threading.Event()

    def beat():
        n = 1
        while not stop.wait(LEASE_S / 6):
            n += 1
            _foreign_beat(storage, 2, n, time.time())

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(OwnerAlive, match="node-7, pid 4242"):
            OwnerLease.claim(storage, "here", LEASE_S)
    finally:
        stop.set()
        beating.join()
    assert epochs(storage) == [0, 1, 2]


def test_a_beating_owner_whose_clock_is_far_behind_ours_is_refused(storage):
    # The holder's host clock runs 11 minutes behind this one: by the wall clocks its last beat is
    # long past the stale limit, but its beat counter still advances. Taking it over would give the
    # root two owners; both a claim and gc's look before its long read watch a beat interval first.
    skew = STALE_FLOOR_S + 60
    _foreign_claim(storage, 0, beat_age_s=skew)
    stop = threading.Event()

    def beat():
        n = 1
        while not stop.wait(LEASE_S / 6):
            n += 1
            _foreign_beat(storage, 0, n, time.time() - skew)

    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(OwnerAlive, match="node-7, pid 4242"):
            OwnerLease.claim(storage, "here", LEASE_S)
        with pytest.raises(OwnerAlive, match="node-7, pid 4242"):
            refuse_a_beating_owner(storage)
    finally:
        stop.set()
        beating.join()
    assert epochs(storage) == [0]


def test_an_owner_silent_for_many_leases_is_taken_after_a_beat_interval_not_a_lease(storage):
    _foreign_claim(storage, 0, beat_age_s=STALE_FLOOR_S + 1)
    started = time.monotonic()
    lease = OwnerLease.claim(storage, "here", LEASE_S)
    # A beat interval and a half (0.3 s) to see its beat stand still, not the lease and a beat (1.4 s).
    assert time.monotonic() - started < LEASE_S
    assert "was last seen" in newest_claim(storage).record["taken_because"]
    lease.release()


def test_a_replaced_owner_changes_nothing_more(storage):
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    catalog = Catalog(storage, owner=lease)
    save_checkpoint(catalog, 10, make_state())
    save_checkpoint(catalog, 20, make_state())
    lease.check()  # still the owner
    _foreign_claim(storage, lease.epoch + 1)  # another driver judged it dead and claimed
    with pytest.raises(OwnershipLost, match="claimed by undying run of job 'elsewhere' on host node-7"):
        save_checkpoint(catalog, 30, make_state())
    with pytest.raises(OwnershipLost):
        catalog.apply_gc(GcPlan(expired=[10], orphans=[]))
    with pytest.raises(OwnershipLost):
        catalog.quarantine(20)
    assert catalog.committed_steps() == [10, 20]  # no manifest of step 30; 10 and 20 untouched
    lease.release()  # a replaced owner does not mark the newer claim ended
    assert not (newest_claim(storage).beat or {}).get("ended")


def test_a_released_owner_changes_nothing_more(storage):
    # Store work the run's end gave up waiting for (a retention pass on a hung store) finishes after
    # the release, while the next claimant takes the root at once: it must change nothing there.
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    catalog = Catalog(storage, owner=lease)
    save_checkpoint(catalog, 10, make_state())
    lease.release()
    with pytest.raises(OwnershipLost, match="released its lease"):
        catalog.apply_gc(GcPlan(expired=[10], orphans=[]))
    assert catalog.committed_steps() == [10]


def test_a_holder_whose_beats_do_not_land_for_a_lease_changes_nothing_until_one_does(storage, monkeypatch):
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    catalog = Catalog(storage, owner=lease)
    save_checkpoint(catalog, 10, make_state())
    save_checkpoint(catalog, 20, make_state())
    real = storage.write_immutable

    def refuses_beats(path, data):
        if "/beat-" in str(path):
            raise OSError(5, "the store refuses the owner's writes")
        return real(path, data)

    monkeypatch.setattr(storage, "write_immutable", refuses_beats)
    time.sleep(LEASE_S * 1.3)  # a claimant watching would take the root at 7/6 of a lease
    with pytest.raises(OwnershipUncertain, match="has not landed for"):
        catalog.apply_gc(GcPlan(expired=[10], orphans=[]))
    with pytest.raises(OwnershipUncertain):
        save_checkpoint(catalog, 30, make_state())
    assert catalog.committed_steps() == [10, 20] and lease.lost is None  # not lost: unsure
    monkeypatch.setattr(storage, "write_immutable", real)
    time.sleep(2 * LEASE_S / 6)  # the next beat lands
    catalog.apply_gc(GcPlan(expired=[10], orphans=[]))
    assert catalog.committed_steps() == [20]
    lease.release()


def test_a_beat_whose_reply_is_slow_counts_from_when_it_was_sent(storage, monkeypatch):
    # A claimant watching the beats saw this one land when it was sent, not when the store answered:
    # the holder must count its freshness from the sending, or it would change the root after the
    # claimant's watch ran out.
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    real, sent = storage.write_immutable, []

    def slow_reply_then_refused(path, data):
        if "/beat-" not in str(path):
            return real(path, data)
        if sent:
            raise OSError(5, "the store refuses the owner's writes")
        sent.append(time.monotonic())
        real(path, data)  # landed: a watcher sees it now
        time.sleep(0.9 * LEASE_S)  # the reply is slow

    monkeypatch.setattr(storage, "write_immutable", slow_reply_then_refused)
    while not sent:
        time.sleep(0.01)
    time.sleep(max(0.0, sent[0] + 1.1 * LEASE_S - time.monotonic()))  # its reply came 0.2 leases ago
    with pytest.raises(OwnershipUncertain, match="has not landed for"):
        lease.check()
    monkeypatch.setattr(storage, "write_immutable", real)
    lease.release()


def test_the_heartbeat_finds_a_newer_claim_without_being_asked(storage):
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    _foreign_claim(storage, lease.epoch + 1)
    deadline = time.monotonic() + 3 * LEASE_S
    while lease.lost is None and time.monotonic() < deadline:  # nothing calls check(): the heartbeat looks
        time.sleep(0.05)
    assert lease.lost is not None and "claimed by undying run of job 'elsewhere'" in lease.lost
    lease.release()


def test_a_torn_beat_file_is_no_beat_and_the_next_beat_mends_it(storage):
    lease = OwnerLease.claim(storage, "first", LEASE_S)
    storage.write_immutable(storage.path(OWNER_DIR, "beat-0000000000.json"), b'{"beat": 3, "ti')  # a torn write
    assert newest_claim(storage).beat is None
    lease.check()  # the lease still works
    with pytest.raises(OwnerAlive, match="heartbeat advanced"):  # and a claimant still sees it beat
        OwnerLease.claim(storage, "second", LEASE_S)
    assert newest_claim(storage).beat["beat"] > 1 and lease.lost is None
    lease.release()


def test_two_claimants_of_a_dead_root_leave_exactly_one_owner(storage):
    _foreign_claim(storage, 0, beat_age_s=STALE_FLOOR_S + 1)
    outcomes: list = []
    barrier = threading.Barrier(2)

    def claim(name):
        barrier.wait()
        try:
            outcomes.append(OwnerLease.claim(storage, name, LEASE_S))
        except OwnerAlive as err:
            outcomes.append(err)

    threads = [threading.Thread(target=claim, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    owners = [o for o in outcomes if isinstance(o, OwnerLease)]
    assert len(owners) == 1 and len(outcomes) == 2 and epochs(storage) == [0, 1]
    owners[0].release()


def test_release_keeps_only_the_recent_claims(storage):
    for _ in range(KEEP_CLAIMS + 3):
        OwnerLease.claim(storage, "run", LEASE_S).release()
        if storage.is_local and epochs(storage)[-1] == 0:  # a beat write killed half-way leaves its temp file
            storage.write_immutable(storage.path(OWNER_DIR, "beat-0000000000.json.tmp-0123"), b"{")
    assert epochs(storage) == list(range(3, KEEP_CLAIMS + 3))
    names = storage.listdir(storage.path(OWNER_DIR))
    assert sorted(n for n in names if n.startswith("beat-")) == [f"beat-{e:010d}.json" for e in range(3, 11)]


def test_an_owner_whose_claim_was_deleted_stops_changing_the_root(storage):
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    lease.check()
    storage.remove_tree(storage.path(OWNER_DIR))  # someone cleaned the folder up
    other = OwnerLease.claim(storage, "new", LEASE_S)  # counts from scratch: epoch 0 again
    assert other.epoch == lease.epoch == 0
    # The old holder's heartbeat may have looked between the wipe and the new claim.
    with pytest.raises(OwnershipLost, match="was claimed by new on host|lost its claim claim-0000000000.json"):
        lease.check()
    lease.release()
    other._beat()  # a fresh beat: the store's calls above may have taken a lease on a loaded machine
    other.check()
    storage.remove_tree(storage.path(OWNER_DIR))
    with pytest.raises(OwnershipLost, match="lost its claim claim-0000000000.json"):
        other.check()
    other.release()


def test_a_claim_interrupted_before_its_first_beat_is_ended_for_the_next_claimant(storage, monkeypatch):
    real = OwnerLease._beat

    def interrupted(self, ended: bool = False):
        if not ended:
            raise KeyboardInterrupt  # Ctrl-C while the first beat is on its way
        real(self, ended=True)

    monkeypatch.setattr(OwnerLease, "_beat", interrupted)
    with pytest.raises(KeyboardInterrupt):
        OwnerLease.claim(storage, "first", LEASE_S)
    monkeypatch.setattr(OwnerLease, "_beat", real)
    assert epochs(storage) == [0] and live_owner(storage) is None  # the claim stands, ended
    started = time.monotonic()
    second = OwnerLease.claim(storage, "second", LEASE_S)
    assert time.monotonic() - started < LEASE_S / 2 and second.epoch == 1  # taken at once, not after a lease
    second.release()


def test_a_claim_interrupted_once_its_heartbeat_runs_stops_beating_and_is_ended(storage, monkeypatch):
    from ckpt import ownership

    def interrupted(*args):
        raise KeyboardInterrupt  # a signal right after the heartbeat thread started

    monkeypatch.setattr(ownership.log, "info", interrupted)
    with pytest.raises(KeyboardInterrupt):
        OwnerLease.claim(storage, "first", LEASE_S)
    assert live_owner(storage) is None and newest_claim(storage).beat["ended"]
    time.sleep(LEASE_S / 2)  # a heartbeat left running would rewrite the beat unended
    assert newest_claim(storage).beat["ended"]
    assert not [t for t in threading.enumerate() if "owner" in t.name.lower() and t.is_alive()]


def test_a_listing_that_misses_our_claim_for_a_while_costs_no_lease(storage, monkeypatch):
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    real_listdir, blind = Storage.listdir, threading.Event()

    def listdir(self, path):  # a remounting share, a failing-over store: the owner folder lists empty
        return [] if blind.is_set() and path.rstrip("/").endswith(OWNER_DIR) else real_listdir(self, path)

    monkeypatch.setattr(Storage, "listdir", listdir)
    blind.set()
    time.sleep(LEASE_S)  # some six heartbeats look meanwhile
    assert lease.lost is None  # our claim, read by its name, is intact: not taken for deleted
    blind.clear()
    lease.check()
    lease.release()


def test_a_bucket_the_store_says_is_missing_for_a_while_costs_no_lease(storage, monkeypatch):
    # S3 answers NoSuchBucket (404) to the listing and to the read of our claim while a bucket fails
    # over: no proof that anyone deleted the claim, so the holder waits, and keeps the root after.
    botocore = pytest.importorskip("botocore.exceptions")
    s3fs_errors = pytest.importorskip("s3fs.errors")
    lease = OwnerLease.claim(storage, "old", LEASE_S)
    real_listdir, real_read, blind = Storage.listdir, Storage.read, threading.Event()

    def missing_bucket() -> BaseException:
        reply = {"Error": {"Code": "NoSuchBucket", "Message": "The specified bucket does not exist"},
                 "ResponseMetadata": {"HTTPStatusCode": 404}}
        return s3fs_errors.translate_boto_error(botocore.ClientError(reply, "GetObject"))

    def listdir(self, path):
        return [] if blind.is_set() and OWNER_DIR in path else real_listdir(self, path)

    def read(self, path, *args, **kwargs):
        if blind.is_set() and OWNER_DIR in path:
            raise missing_bucket()
        return real_read(self, path, *args, **kwargs)

    monkeypatch.setattr(Storage, "listdir", listdir)
    monkeypatch.setattr(Storage, "read", read)
    blind.set()
    with pytest.raises(OwnershipUncertain, match="says the bucket of .* does not exist"):
        lease._look_for_newer()
    time.sleep(LEASE_S)  # some six heartbeats look meanwhile
    assert lease.lost is None
    blind.clear()
    lease._beat()  # a beat lands again once the bucket is back
    lease.check()
    lease.release()
