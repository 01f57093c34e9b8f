"""The wire protocol between ranks and controller: every message round-trips through JSON, bad
ones are refused naming the type or field, and the chaos library's notices decode as FaultFired."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.injector import FaultInjector
from chaos.storage_rules import StorageFaultPlan
from ckpt.manifest import ShardReceipt
from orchestrator.wire.messages import (
    MESSAGES,
    CheckpointPlan,
    EvalDone,
    FaultFired,
    Heartbeat,
    MemoryReport,
    NodeLost,
    SaveFailed,
    ShardWritten,
    SnapshotHeld,
    StepDone,
    decode,
    encode,
)
from orchestrator.wire.store import RendezvousServer, connect

RECEIPT = ShardReceipt(step=10, rank=1, file="shard-r1.bin", nbytes=64, tensors={},
                       blocking_s=0.01, write_s=0.2)
EXAMPLES = [
    StepDone(step=3, loss=2.5, tokens=512, step_s=0.1, time=1e9, compute_s=0.08, grad_norm=1.2, lr=1e-3,
             bubble=0.2, loss_scale=1024.0, data_wait_s=0.003),
    ShardWritten(RECEIPT, {"engine": {"next_step": 10}, "samples": [0, 10, 40, 2**64 - 1]}),
    SnapshotHeld(RECEIPT, ["actor-a", "actor-b"], {"engine": {"next_step": 10}, "held_bytes": 4096}),
    EvalDone(step=10, loss=3.25, tokens=2048, seconds=0.4),
    SaveFailed(rank=1, step=10, error="OSError: disk full"),
    FaultFired(fault_id=2, kind="kill_rank", time=1e9, rank=1, step=25, point="after_backward"),
    NodeLost(node="abc123", rank=3, time=1e9),
    MemoryReport(ledgers={"state": 1024, "activation": 2048}),
    MemoryReport(ledgers=None),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message):
    wire = json.loads(json.dumps(encode(message)))
    assert wire["type"] == message.type and decode(wire) == message


def test_the_dispatch_table_names_every_message_type_once():
    assert set(MESSAGES) == {"step", "receipt", "snapshot", "save_error", "fault", "node_lost", "memory", "eval"}
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())


def test_bad_events_are_refused_naming_the_type_or_the_field():
    with pytest.raises(ValueError, match="unknown event type 'heartbeat'"):
        decode({"type": "heartbeat", "rank": 0})
    with pytest.raises(ValueError, match=r"save_error event: unknown field\(s\) \['stepp'\]"):
        decode({"type": "save_error", "rank": 0, "stepp": 3, "error": "x"})
    with pytest.raises(ValueError, match="node_lost event"):
        decode({"type": "node_lost", "node": "n"})


def test_chaos_notices_decode_as_fault_fired():
    notices: list[dict] = []
    hook = FaultInjector.hook_for([{"id": 4, "kind": "nan_grad", "rank": 0, "at_step": 1}], 0, notices.append)
    with pytest.raises(RuntimeError, match="nan_grad needs the engine's module"):
        hook("after_backward", 1)  # notifies before it acts
    plan = StorageFaultPlan([{"id": 7, "kind": "storage_error", "op": "write", "nth": 1}], notify=notices.append)
    plan.judge("write", "root/step-000000010/shard-r0.bin")
    rank_fault, storage_fault = (decode(n) for n in notices)
    assert (rank_fault.fault_id, rank_fault.kind, rank_fault.step, rank_fault.point) == (4, "nan_grad", 1,
                                                                                        "after_backward")
    assert (storage_fault.fault_id, storage_fault.op, storage_fault.mode) == (7, "write", "before")


def test_messages_travel_through_the_generation_store():
    store = RendezvousServer("127.0.0.1").generation(0)
    for message in EXAMPLES:
        store.send(message)
    store.send({"type": "fault", "fault_id": 1, "kind": "hang_rank", "rank": 0, "step": 2, "point": "x",
                "time": 1.0})
    received = store.receive()
    assert received[:-1] == EXAMPLES and received[-1] == FaultFired(1, "hang_rank", time=1.0, rank=0, step=2,
                                                                    point="x")
    with pytest.raises(ValueError, match="unknown event type"):
        store.send({"type": "typo"})  # refused where it is made, not at the controller


def test_a_heartbeat_round_trips_as_its_key_value():
    for beat in (Heartbeat(step=7, time=1e9, compute_s=0.25),
                 Heartbeat(step=7, time=1e9, compute_s=0.25, saving=8, saved_bytes=123)):
        assert Heartbeat.from_json(json.loads(json.dumps(beat.to_json()))) == beat
    # A rank of a release before save progress existed: training, nothing written.
    assert Heartbeat.from_json({"step": 3, "time": 1.0, "compute_s": 0.5}) == Heartbeat(3, 1.0, 0.5, None, 0)


def test_checkpoint_plan_round_trips_and_saves_on_its_cadence():
    plan = CheckpointPlan(every=5, anchor=3, version=2, final_step=21, tag="abc g1", job_started_at=1e9)
    assert CheckpointPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert [s for s in range(1, 22) if plan.should_save(s)] == [8, 13, 18, 21]


def test_the_controllers_handled_mark_never_travels():
    fired = FaultFired(3, "kill_rank", time=1.0, rank=0, step=4, point="after_backward", handled=True)
    assert "handled" not in encode(fired)
    assert decode({**encode(fired), "handled": True}).handled is False


def test_an_event_that_is_not_a_message_is_skipped_and_the_rest_received(caplog):
    store = RendezvousServer("127.0.0.1").generation(0)
    store.send(EXAMPLES[2])
    store.push_event({"type": "from_another_release", "x": 1})
    store.send(EXAMPLES[4])
    with caplog.at_level("ERROR"):
        assert store.receive() == [EXAMPLES[2], EXAMPLES[4]]
    assert "not a wire message" in caplog.text
    # Sealed events of the right types whose fields are missing or of the wrong kind (a bug, another
    # release): skipped as well, not raised through the controller's intake, the batch's others kept.
    for bad in ({"type": []}, {"type": "receipt"}, {"type": "snapshot", "receipt": {}, "holders": 3},
                {"type": "receipt", "receipt": EXAMPLES[1].to_json()["receipt"], "extra": [1]}):
        store.send(EXAMPLES[2])
        store.push_event(bad)
        store.send(EXAMPLES[4])
        assert store.receive() == [EXAMPLES[2], EXAMPLES[4]], bad


def test_a_heartbeat_or_a_plan_that_does_not_parse_is_a_value_error():
    for bad in ({"step": 3}, [1, 2]):
        with pytest.raises(ValueError, match="heartbeat event"):
            Heartbeat.from_json(bad)
    with pytest.raises(ValueError):
        Heartbeat.from_json({"step": "x", "time": 1.0, "compute_s": 0.5})
    with pytest.raises(ValueError, match="plan event: TypeError"):
        CheckpointPlan.from_json({"every": 5, "version": 2, "from_a_newer_release": 1})


class _Counting:
    """A store client that records the name of every call (each is one round trip)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


def test_a_rank_reads_an_unchanged_plan_in_one_round_trip():
    from orchestrator.rank.loop import PlanWatch

    server = RendezvousServer("127.0.0.1")
    controller, rank = server.generation(0), connect(server.address, 0, timeout_s=10)
    controller.set_plan(CheckpointPlan(every=10, version=1).to_json())
    rank.store = counting = _Counting(rank.store)
    plans = PlanWatch(rank)
    assert plans.read() == CheckpointPlan(every=10, version=1)
    counting.calls.clear()
    for _ in range(100):  # step boundaries
        plans.read()
    assert counting.calls == ["add"] * 100
    controller.set_plan(CheckpointPlan(every=5, version=2, stop_at=40).to_json())
    assert plans.read() == CheckpointPlan(every=5, version=2, stop_at=40)


def test_dropping_the_generations_before_one_deletes_their_keys_and_no_other_s():
    # Generation 0 failed before it trained (nothing dropped then); generation 2 trains: 0 and 1 go.
    server = RendezvousServer("127.0.0.1")
    failed, old, new = server.generation(0), server.generation(1), connect(server.address, 2, timeout_s=10)
    for gen_store in (failed, old, new):
        gen_store.set_plan(CheckpointPlan(every=10, version=1).to_json())
        gen_store.set_json("hb/0", {"step": 3})
        gen_store.push_event({"type": "step", "step": 3})
        gen_store.pg_store().set("0", b"bootstrap")  # what torch.distributed writes at rendezvous
    before = len(server._server.list_keys())
    assert server.drop_generations_before(2) == 2 * before // 3 and server.drop_generations_before(2) == 0
    assert not old.store.check(["plan"]) and old.get_json("hb/0") is None and failed.get_json("hb/0") is None
    assert new.get_json("hb/0") == {"step": 3} and new.plan_sets() == 1 and new.pg_store().get("0") == b"bootstrap"
    assert len(new.drain_events()) == 1
    kept = len(server._server.list_keys())
    old.set_json("hb/0", {"step": 4})  # a heartbeat thread of the dropped generation, late
    late = len(server._server.list_keys()) - kept
    assert late == 1 and server.drop_generations_before(2) == 1  # recreated after the drop: it goes too
    assert len(server._server.list_keys()) == kept and new.get_json("hb/0") == {"step": 3}


def _timers_of_connections_to(port: int) -> list[str]:
    """The `tr` (timer) field of every established IPv4 connection whose local port is `port`
    (/proc/net/tcp: 02 is the keepalive timer)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [row[5].split(":")[0] for row in rows if int(row[1].split(":")[1], 16) == port and row[3] == "01"]


def test_every_connection_the_store_accepts_has_tcp_keepalive():
    """So a rank whose node vanished without closing its sockets does not hold them open for good."""
    server = RendezvousServer("127.0.0.1")
    rank = connect(server.address, 0, timeout_s=10)
    rank.set_json("hb/0", {"step": 1})
    timers = _timers_of_connections_to(server.port)
    assert timers and all(timer == "02" for timer in timers), timers


def test_the_store_s_connections_give_up_on_unacknowledged_data_within_the_keepalive_s_60_s():
    """Keepalive sends no probe while an answer is unacknowledged (a rank's node vanished mid-request):
    the listener's TCP_USER_TIMEOUT, which Linux gives every accepted connection, bounds that too."""
    import socket

    from orchestrator.wire.store import _keep_alive

    listener = socket.socket()
    _keep_alive(listener)  # as the store's listening socket, before torch's TCPStore accepts on it
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with listener, socket.create_connection(listener.getsockname()), listener.accept()[0] as accepted:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 60_000  # inherited
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30


def test_a_store_error_while_dropping_keys_leaves_them_for_the_next_generation_to_drop():
    server = RendezvousServer("127.0.0.1")
    server.generation(0).set_json("hb/0", {"step": 1})
    real = server._server

    class FailsOnce:  # the store's listing fails once (a TCPStore's methods cannot be patched)
        failed = False

        def list_keys(self):
            if not self.failed:
                self.failed = True
                raise RuntimeError("store unreachable")
            return real.list_keys()

        def delete_key(self, key):
            return real.delete_key(key)

    server._server = FailsOnce()
    assert server.drop_generations_before(1) == 0
    assert server.drop_generations_before(2) == 1  # generation 0's key, left by the failed drop
    server._server = real
    assert server.generation(0).get_json("hb/0") is None

