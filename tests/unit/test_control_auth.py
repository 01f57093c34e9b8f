"""The sealed control plane (orchestrator.wire.auth, wire.store): a value without a valid tag
under the job's secret is dropped and counted, whoever wrote it and wherever it is replayed."""

from __future__ import annotations

import functools
import json
import pickle
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckpt.storage import Storage
from monitor.metrics import JobMetrics
from orchestrator.wire.auth import Rejected, Seal, StoreAddress, key_prefix, new_secret
from orchestrator.wire.store import ABORT, EVENTS, PLAN, RendezvousServer, connect, heartbeat_key
from tests._sockets import listening_sockets
from tests.unit.test_controller import FakeWorkerGroup, _controller, _spec

SECRET = new_secret()
STEP = {"type": "step", "step": 3, "loss": 1.0, "tokens": 8, "step_s": 0.1, "time": 0.0}


def test_a_sealed_value_opens_with_its_secret_generation_and_key():
    sealed = Seal(SECRET, 2).seal("hb/0", '{"step": 1}')
    assert Seal(SECRET, 2).open("hb/0", sealed.encode(), queued=True) == '{"step": 1}'


@pytest.mark.parametrize(("secret", "gen", "key", "reason"), [
    (new_secret(), 2, "hb/0", "invalid tag"),  # another job's secret (or none known)
    (SECRET, 3, "hb/0", "invalid tag"),  # replayed into the next generation
    (SECRET, 2, "hb/1", "invalid tag"),  # copied under another key
], ids=["wrong-secret", "next-generation", "other-key"])
def test_a_sealed_value_does_not_open_elsewhere(secret, gen, key, reason):
    sealed = Seal(SECRET, 2).seal("hb/0", '{"step": 1}')
    with pytest.raises(Rejected, match=reason):
        Seal(secret, gen).open(key, sealed, queued=False)


@pytest.mark.parametrize("forge", [
    lambda v: v.replace('"step": 1', '"step": 9'),  # tampered body
    lambda v: "0" * 64 + v[64:],  # tag replaced
    lambda v: v[:66] + v[66:].replace(":", ":1", 1),  # another sequence number
])
def test_a_tampered_value_is_rejected(forge):
    sealed = Seal(SECRET, 0).seal(EVENTS, '{"step": 1}')
    with pytest.raises(Rejected, match="invalid tag"):
        Seal(SECRET, 0).open(EVENTS, forge(sealed), queued=True)


@pytest.mark.parametrize("raw", [b"1", json.dumps(STEP).encode(), b"\xff\xfe:a:b:c", b"a:b:c:d",
                                 ("\u00e9" * 64 + ":0123456789abcdef:0:{}").encode(), "\ud800" * 64 + ":s:0:{}"],
                         ids=["abort", "json", "not-utf8", "short-tag", "non-ascii-tag", "surrogate-tag"])
def test_a_value_without_a_tag_is_rejected_without_reading_it(raw):
    with pytest.raises(Rejected, match="no tag|invalid tag") as err:
        Seal(SECRET, 0).open(EVENTS, raw, queued=True)
    assert "step" not in str(err.value)  # the contents are never echoed


def test_a_queued_value_opens_once_and_a_key_never_goes_back():
    writer, reader = Seal(SECRET, 0), Seal(SECRET, 0)
    first, second = writer.seal(EVENTS, "a"), writer.seal(EVENTS, "b")
    assert reader.open(EVENTS, first, queued=True) == "a"
    assert reader.open(EVENTS, second, queued=True) == "b"
    with pytest.raises(Rejected, match="replayed"):
        reader.open(EVENTS, first, queued=True)
    old, new = writer.seal(PLAN, "v1"), writer.seal(PLAN, "v2")
    assert reader.open(PLAN, new, queued=False) == reader.open(PLAN, new, queued=False) == "v2"
    with pytest.raises(Rejected, match="replayed"):
        reader.open(PLAN, old, queued=False)


def test_the_secret_is_in_no_repr_and_survives_pickling():
    address = StoreAddress("127.0.0.1", 1234, SECRET)
    assert SECRET.hex() not in repr(address) and str(SECRET) not in repr(address)
    assert pickle.loads(pickle.dumps(address)) == address  # as Ray sends it to the rank actors


def test_the_store_listens_on_the_host_it_is_given_only():
    server = RendezvousServer("127.0.0.1")
    assert ("127.0.0.1", server.port) in listening_sockets()
    assert ("0.0.0.0", server.port) not in listening_sockets()
    assert ("::", server.port) not in listening_sockets()


def _metrics_count(metrics: JobMetrics, channel: str) -> float:
    value = metrics.registry.get_sample_value(
        "undying_control_messages_rejected_total", {"undying_job": metrics.job, "channel": channel})
    return value or 0.0


FORGER = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
prefix = sys.argv[3]
store.set(f"{prefix}/abort", "1")
store.set(f"{prefix}/hb/0", json.dumps({"step": 99, "time": 0.0, "compute_s": 50.0}))
for event in json.loads(sys.argv[2]):
    store.queue_push(f"{prefix}/events", json.dumps(event))
store.check(["round-trip"])  # pushes are not answered: wait until the server has them
"""


def test_a_generation_s_keys_cannot_be_guessed_without_the_secret_but_can_be_listed():
    """A client that reaches the port but has no secret writes every key it can guess (the
    generation's old names): nothing of it is ever read. It can list the job's keys, though
    (torch's TCPStore answers `list_keys` to any client): what it does with them is the next
    test's, and docs/design.md's security model counts on the bind and the tags, not the names."""
    server = RendezvousServer("127.0.0.1")
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    controller.set_plan({"every": 10, "version": 1})
    guesser = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    assert not any(guesser.check([f"gen{gen}/{key}"]) for gen in (0, 1) for key in (PLAN, "plan_sets"))
    subprocess.run([sys.executable, "-c", FORGER, str(server.port), json.dumps([STEP]), "gen0"], check=True,
                   timeout=60)
    guesser.set("gen0/pg/0", "a forged bootstrap address")
    assert controller.receive() == [] and not rank.abort_requested()
    assert not rank.pg_store().check(["0"])  # the ranks' bootstrap keys are elsewhere
    assert server.rejections.counts == {}  # nothing it wrote is read: nothing to count
    assert key_prefix(server.address.secret, 0) != key_prefix(new_secret(), 0)
    assert key_prefix(server.address.secret, 0) != key_prefix(server.address.secret, 1)
    assert f"{key_prefix(server.address.secret, 0)}/{PLAN}" in guesser.list_keys()


def test_another_process_without_the_secret_changes_nothing_and_is_counted():
    """A process that learned the key names (by reading the store's traffic) but has no secret."""
    metrics = JobMetrics("forged")
    server = RendezvousServer("127.0.0.1", on_reject=metrics.on_control_rejected)
    controller = server.generation(0)
    rank = connect(server.address, 0, timeout_s=10)
    rank.set_json(heartbeat_key(0), {"step": 1, "time": 1.0, "compute_s": 1.0})
    rank.send(_step())  # one genuine step record, queued first
    forged = [{"type": "node_lost", "node": "head", "rank": 0, "time": 0.0},
              {"type": "receipt", "receipt": {"step": 10, "rank": 0}, "extra": {}}, STEP]
    subprocess.run([sys.executable, "-c", FORGER, str(server.port), json.dumps(forged),
                    key_prefix(server.address.secret, 0)], check=True, timeout=60)

    assert [m.step for m in controller.receive()] == [3]  # only the genuine record
    assert controller.get_json(heartbeat_key(0)) is None  # the forged heartbeat reads as absent
    assert controller.get_json(heartbeat_key(0)) is None  # ... and is counted once
    assert not rank.abort_requested() and not rank.abort_requested()
    assert server.rejections.counts == {"events": 3, "heartbeat": 1}
    controller.receive()  # the rank's notice of the forged abort
    assert server.rejections.counts == {"events": 3, "heartbeat": 1, "abort": 1}
    assert [_metrics_count(metrics, c) for c in ("events", "heartbeat", "abort")] == [3, 1, 1]
    controller.request_abort()  # the controller's own abort still gets through
    assert rank.abort_requested()


def _step(step: int = 3):
    from orchestrator.wire.messages import StepDone

    return StepDone(step=step, loss=1.0, tokens=8, step_s=0.1, time=0.0)


def test_an_event_popped_by_a_stranger_mid_drain_loses_nothing_the_drain_took():
    """Any client that reaches the port may pop the queue: the drain's pops find it emptier than its
    count said, which ends the drain with what it took, not an error that would end the job."""
    server = RendezvousServer("127.0.0.1")
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    for step in (3, 4):
        rank.send(_step(step))
    stranger = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    real, store = controller.store.queue_pop, controller.store

    class PoppedMeanwhile:  # a TCPStore's methods cannot be patched: wrap the store instead
        def __getattr__(self, name):
            return getattr(store, name)

        def queue_pop(self, key, block=True):
            value = real(key, block=block)
            stranger.queue_pop(f"{key_prefix(server.address.secret, 0)}/{EVENTS}")  # the next one, taken
            return value

    controller.store = PoppedMeanwhile()
    assert [m.step for m in controller.receive()] == [3]


def test_a_captured_event_replayed_on_the_queue_is_dropped():
    server = RendezvousServer("127.0.0.1")
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    eavesdropper = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    rank.send(_step())
    prefix = functools.partial(key_prefix, server.address.secret)  # names read off the wire
    captured = eavesdropper.queue_pop(f"{prefix(0)}/{EVENTS}")  # (waits for the push)
    for gen in (0, 0, 1):  # put back, replayed, then replayed into the next generation
        eavesdropper.queue_push(f"{prefix(gen)}/{EVENTS}", captured)
    assert [m.step for m in controller.receive()] == [3]
    assert server.generation(1).receive() == []
    assert server.rejections.counts == {"events": 2}


def test_sealing_a_step_record_costs_microseconds():
    seal, body = Seal(SECRET, 0), json.dumps(STEP)
    started = time.perf_counter()
    for _ in range(1000):
        seal.open(EVENTS, seal.seal(EVENTS, body), queued=True)
    assert (time.perf_counter() - started) / 1000 < 200e-6  # ~10 us here; a step is milliseconds at least


def test_the_abort_key_a_rank_reads_is_sealed():
    server = RendezvousServer("127.0.0.1")
    rank = connect(server.address, 0, timeout_s=10)
    server.generation(1).request_abort()  # another generation's abort is not this one's
    assert not rank.abort_requested()
    server.generation(0).request_abort()
    assert rank.abort_requested() and rank.get_json(ABORT) == 1


class ForgedWorkerGroup(FakeWorkerGroup):
    """The fake ranks of tests.unit.test_controller, and a client without the secret that writes
    every control key it can when training starts: each forgery, if trusted, would change the job."""

    def start_training(self, until_step, faults, **kwargs):
        super().start_training(until_step, faults, **kwargs)
        forger = dist.TCPStore("127.0.0.1", self.rendezvous.port, is_master=False, timeout=timedelta(seconds=10))
        prefix = key_prefix(self.rendezvous.address.secret, self.gen)  # as read off the wire
        forger.set(f"{prefix}/{ABORT}", "1")  # every rank would stop
        for event in ({"type": "node_lost", "node": "head", "rank": 0, "time": 0.0},  # a recovery
                      {"type": "save_error", "rank": 0, "step": 10, "error": "forged"},  # a skipped save
                      STEP | {"loss": 999.0}):  # a loss in the report
            forger.queue_push(f"{prefix}/{EVENTS}", json.dumps(event))
        forger.check(["round-trip"])  # pushes are not answered: wait until the server has them


def test_forged_control_messages_leave_a_running_job_as_it_was(tmp_path):
    spec = _spec(tmp_path)
    rendezvous = RendezvousServer("127.0.0.1")
    workers = ForgedWorkerGroup(rendezvous, Storage(spec.checkpoint_root))
    controller = _controller(spec, workers, rendezvous, [])
    rendezvous.rejections.on_reject = controller.metrics.on_control_rejected  # as run.py wires it
    report = controller.run()
    assert report.status == "succeeded" and report.failures == []
    assert [w.generation for w in report.world_history] == [0]
    assert [p.loss for p in report.losses] == [10.0 / (step + 1) for step in range(30)]
    assert controller.catalog.committed_steps() == [20, 30]
    assert rendezvous.rejections.counts == {"events": 3, "abort": 1}
    assert [_metrics_count(controller.metrics, c) for c in ("events", "abort")] == [3, 1]


def test_a_forged_plan_leaves_a_rank_on_its_current_plan():
    from orchestrator.rank.loop import plan_from_store
    from orchestrator.wire.messages import CheckpointPlan

    server = RendezvousServer("127.0.0.1")
    rank = connect(server.address, 0, timeout_s=10)
    current = CheckpointPlan(every=10, version=1)
    forger = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    forger.set(f"{key_prefix(server.address.secret, 0)}/{PLAN}", json.dumps({"every": 1, "version": 99}))
    assert plan_from_store(rank, current) is current
    server.generation(0).set_json(PLAN, {"every": 5, "version": 2})
    assert plan_from_store(rank, current) == CheckpointPlan(every=5, version=2)
    # A sealed plan of another release (a field this one lacks) leaves it on its plan too, not failed.
    server.generation(0).set_json(PLAN, {"every": 5, "version": 3, "from_a_newer_release": True})
    assert plan_from_store(rank, current) is current
    server.generation(0).set_json(PLAN, [5, 3])
    assert plan_from_store(rank, current) is current


def test_many_heartbeats_read_in_one_batch_open_like_single_reads():
    """GenerationStore.get_many_json: absent keys, forged values and the batched path agree with get_json."""
    server = RendezvousServer("127.0.0.1")
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    keys = [heartbeat_key(r) for r in range(4)]
    for r in (0, 2):
        rank.set_json(keys[r], {"step": r})
    # Not every key exists yet (a rank that has not beaten): read key by key, absent ones as None.
    assert controller.get_many_json(keys) == [{"step": 0}, None, {"step": 2}, None]
    forger = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    prefix = key_prefix(server.address.secret, 0)
    forger.set(f"{prefix}/{keys[1]}", json.dumps({"step": 99}))
    rank.set_json(keys[3], {"step": 3})
    # The keys seen before are batched, the new ones read one by one; then every key is batched.
    controller.store = _Calls(controller.store)
    assert controller.get_many_json(keys) == [{"step": 0}, None, {"step": 2}, {"step": 3}]
    assert controller.store.calls == ["check", "multi_get", "check", "get", "check", "get"]
    controller.store.calls.clear()
    assert controller.get_many_json(keys) == [{"step": 0}, None, {"step": 2}, {"step": 3}]
    assert controller.store.calls == ["check", "multi_get"]  # two round trips for every rank
    # The forged value is dropped and counted once however often it is read.
    assert controller.get_many_json(keys, default={}) == [{"step": 0}, {}, {"step": 2}, {"step": 3}]
    assert [controller.get_json(k) for k in keys] == controller.get_many_json(keys)
    assert server.rejections.counts == {"heartbeat": 1}
    assert controller.get_many_json([]) == []
    forger.delete_key(f"{prefix}/{keys[2]}")  # a key gone (only a client on the port can): read again one by one
    assert controller.get_many_json(keys) == [{"step": 0}, None, None, {"step": 3}]


class _Calls:
    """A store that records which of its methods were called."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


def test_an_event_another_client_pops_off_the_queue_is_counted_as_missing():
    """Apart from rejected ones: a pop proves no forgery (a push that failed leaves the same gap)."""
    metrics = JobMetrics("popped")
    server = RendezvousServer("127.0.0.1", on_missing=metrics.on_control_missing)
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    thief = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    queue = f"{key_prefix(server.address.secret, 0)}/{EVENTS}"
    rank.set_json(heartbeat_key(0), {"step": 1})  # a key value between events: its own sequence
    for step in (1, 2, 3, 4):
        rank.send(_step(step))
    thief.queue_pop(queue)  # step 1's record: the first of this sender's, gone before the controller looked
    assert [m.step for m in controller.receive()] == [2, 3, 4]
    assert server.rejections.missing == {"events": 1} and not server.rejections.counts
    rank.send(_step(5))
    rank.send(_step(6))
    thief.queue_pop(queue)
    assert [m.step for m in controller.receive()] == [6] and server.rejections.missing == {"events": 2}
    assert controller.receive() == [] and server.rejections.missing == {"events": 2}  # counted once
    assert metrics.registry.get_sample_value("undying_control_messages_missing_total",
                                             {"undying_job": "popped", "channel": "events"}) == 2.0
