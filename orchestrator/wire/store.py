"""The rendezvous store, hosted by the controller, and the per-generation key space.

The controller owns one `torch.distributed.TCPStore` server for the life of the job, so
losing any rank never loses the store (docs/design.md section 2). Each membership generation
uses its own key prefix: process-group bootstrap keys, the abort flag, the checkpoint plan,
heartbeats and the event queue. Messages of an old generation live under an old prefix and
are never read again. The prefix, `gen<g>-<32 hex>`, is derived from the job's secret
(orchestrator.wire.auth.key_prefix), so that nobody without it can name a key of the job.

Key space under a generation's prefix (who writes -> who reads):
  pg/...         torch.distributed bootstrap (ranks -> ranks; not sealed, see wire.auth)
  abort          "1" when the controller wants every rank out (controller -> ranks)
  plan           checkpoint plan JSON (controller -> ranks, read when `plan_sets` moved)
  plan_sets      how many times the plan was set: a counter a rank reads at every step
                 boundary in one round trip (controller -> ranks; not sealed, see set_plan)
  hb/<rank>      last heartbeat JSON of a rank (rank -> controller)
  events         queue of JSON events: step records, shard receipts, fault notices (ranks -> controller)

Every value but `pg/...` and the `plan_sets` counter is sealed with the job's secret
(orchestrator.wire.auth); a reader drops what does not open. A rank that drops a value tells
the controller with a sealed `control_rejected` notice on the queue, so that the controller
counts every rejection, its own and the ranks', in one metric.

The server listens on the host it is given and nowhere else: torch's TCPStore binds the
wildcard address whatever host it is passed, so the listening socket is made here, bound to
that host, and handed to the store (libuv backend, `master_listen_fd`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from orchestrator.wire.auth import (
    Rejected,
    Rejections,
    Seal,
    StoreAddress,
    channel_of,
    generation_of_key,
    key_prefix,
    new_secret,
)
from orchestrator.wire.messages import Message, decode, encode

log = logging.getLogger(__name__)

EVENTS = "events"
ABORT = "abort"
PLAN = "plan"
PLAN_SETS = "plan_sets"
REJECTED = "control_rejected"  # a rank's notice that it dropped a value (see module doc)
_LISTEN_BACKLOG = 1024  # every rank opens several clients at once when a generation forms
# TCP keepalive on every connection the store accepts: the store only ever answers, so without
# it a rank whose node vanished without closing its connections (power loss, a reclaimed VM)
# would hold its sockets open on the controller for the rest of the job, a few per rank per
# lost node, until the controller ran out of descriptors. With it such a connection fails after
# about IDLE + COUNT x INTERVAL = 60 s of silence from its peer. Keepalive sends no probe while data
# sent is unacknowledged (an answer to a rank whose node vanished mid-request), so the same 60 s also
# bound that (TCP_USER_TIMEOUT; the retransmissions would take about 15 minutes). Both are set on the
# listening socket, and Linux gives them to every connection it accepts.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3
UNACKNOWLEDGED_MS = 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S)


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


class RendezvousServer:
    """Controller side. Create once per job; `generation(g)` gives that generation's key space,
    `address` what ranks need to join it (the secret included).

    `on_reject(channel)` is called for every control message dropped, by the controller or a
    rank (run.py passes the metrics' `on_control_rejected`), `on_missing(channel, n)` for queued
    ones that never arrived (`on_control_missing`); `rejections` keeps the totals."""

    def __init__(self, host: str, port: int = 0, on_reject=None, on_missing=None):
        self.host = host
        self._secret = new_secret()
        self.rejections = Rejections(on_reject, on_missing)
        self._server = _listening_store(host, port)
        self.port = self._server.port

    @property
    def address(self) -> StoreAddress:
        return StoreAddress(self.host, self.port, self._secret)

    def generation(self, gen: int) -> GenerationStore:
        return GenerationStore(dist.PrefixStore(key_prefix(self._secret, gen), self._server), Seal(self._secret, gen),
                               self.rejections)

    def drop_generations_before(self, gen: int) -> int:
        """Delete every key of the generations before `gen` (their process-group bootstrap, heartbeats,
        plan, abort flag); returns how many. The controller calls it once generation `gen` trains:
        every survivor has left the older ones by then (they joined this one), and a job with a
        thousand failures would otherwise keep a thousand generations' keys; so would one whose
        generations fail before they train, were only the previous one dropped. Every older
        generation's keys, not only those since the last drop: a thread of a generation that ended
        (a heartbeat behind a save left to finish) can write one after its generation was dropped.
        The event queues are not keys (the store neither lists nor deletes them): the controller
        pops them empty, and a receipt pushed late stays, a few hundred bytes per save left to
        finish. Housekeeping: a store error here is logged and the keys stay (the next drop finds
        them), the job goes on."""
        try:
            keys = [key for key in self._server.list_keys()
                    if (old := generation_of_key(self._secret, key)) is not None and old < gen]
            for key in keys:
                self._server.delete_key(key)
        except (RuntimeError, OSError) as err:  # torch raises DistStoreError, a RuntimeError
            log.warning("could not delete the store keys of the generations before %d (%s); the next generation "
                        "to train tries again", gen, err)
            return 0
        return len(keys)


def _listening_store(host: str, port: int) -> dist.TCPStore:
    """A TCPStore server that listens on `host` only (TCPStore itself would bind every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=_LISTEN_BACKLOG)
    _keep_alive(sock)  # Linux: the accepted sockets inherit the listener's keepalive settings
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here on (libuv closes it)
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                             master_listen_fd=fd, timeout=timedelta(seconds=30))
    except BaseException:
        socket.socket(fileno=fd).close()
        raise


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", UNACKNOWLEDGED_MS)):
        if hasattr(socket, option):  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class GenerationStore:
    """One generation's key space; used by the controller and (through `connect`) by ranks.

    Values are sealed on write and opened on read (orchestrator.wire.auth); a value that does
    not open reads as absent. `rejections`: the controller's counter; None on a rank, which
    counts its own and also sends the controller a notice of each. Thread-safe (one lock per client), though each
    thread should still have its own client: a blocked call holds the lock.
    """

    def __init__(self, store: dist.Store, seal: Seal, rejections: Rejections | None = None):
        self.store = store
        self._seal = seal
        self._rejections = rejections or Rejections()
        self._on_rank = rejections is None
        self._lock = threading.RLock()  # a sealed value's seq and its place in the queue must agree
        self._dropped: dict[str, bytes] = {}  # key -> the last value dropped (counted once)
        self._present: set[str] = set()  # keys get_many_json found: batched from then on

    def pg_store(self) -> dist.Store:
        return dist.PrefixStore("pg", self.store)

    def push_event(self, event: dict) -> None:
        """Queue `event` for the controller: sealed and pushed under one lock, so this client's
        queued seqs stay in push order (a push that fails leaves a gap the controller counts)."""
        with self._lock:
            self.store.queue_push(EVENTS, self._seal.seal(EVENTS, json.dumps(event)))

    def send(self, message: Message | dict) -> None:
        """Queue a message for the controller; a dict is a chaos fault notice (see wire.messages)."""
        self.push_event(encode(decode(message) if isinstance(message, dict) else message))

    def receive(self, limit: int = 10_000) -> list[Message]:
        """Every queued message, oldest first, without blocking (the controller's intake).

        An event that is not a message (a rank of another release, a bug) is logged and skipped:
        the others of the batch are already off the queue, and the job must not stop for it."""
        out: list[Message] = []
        for event in self.drain_events(limit):
            try:
                out.append(decode(event))
            except ValueError as err:
                log.error("ignoring an event that is not a wire message (%s): %s", err, event)
        return out

    def drain_events(self, limit: int = 10_000) -> list[dict]:
        """Every queued event that opens, oldest first, without blocking; the others are counted, and
        so, as missing, are events a sender's sequence skips (wire.auth), and the ranks' rejection
        notices, which are taken here."""
        out: list[dict] = []
        with self._lock:
            pending = self.store.queue_len(EVENTS)
            for _ in range(min(pending, limit)):
                try:
                    raw = self.store.queue_pop(EVENTS, block=False)
                except dist.QueueEmptyError:  # another client popped meanwhile: what was taken so far is kept
                    break
                body = self._open(EVENTS, raw, queued=True)
                event = _json_object(body) if body is not None else None
                if event is not None and event.get("type") == REJECTED:
                    self._rejections.count(str(event.get("channel")), str(event.get("reason")), "a rank")
                elif event is not None:
                    out.append(event)
            missing = self._seal.take_missing()
            if missing:
                self._rejections.count_missing(channel_of(EVENTS), missing)
        return out

    def set_json(self, key: str, value) -> None:
        with self._lock:
            self.store.set(key, self._seal.seal(key, json.dumps(value)))

    def get_json(self, key: str, default=None):
        """The value of `key`; `default` when it is absent or does not open."""
        with self._lock:
            # TCPStore.get blocks until the key exists: check first.
            if not self.store.check([key]):
                return default
            body = self._open(key, self.store.get(key), queued=False)
        return default if body is None else json.loads(body)

    def get_many_json(self, keys: list[str], default=None) -> list:
        """The values of `keys`, in order, each `default` when absent or when it does not open.

        The keys seen before in this generation (none is deleted within one) are read in one batch,
        `check` then `multi_get`; the others key by key, so a rank that never beat costs one round
        trip, not the batch. The controller reads every rank's heartbeat each period: key by key
        that took 0.25 s at 1024 ranks, batched 7 ms (bench/store_reads.py). `multi_get` blocks on
        a missing key like `get` does: a key deleted between the check and the read (only a client
        that reaches the port can) stalls it for the store's timeout, then it is read key by key."""
        with self._lock:
            raws = self._read_present([k for k in keys if k in self._present])
            for key in keys:
                if key not in raws and self.store.check([key]):
                    raws[key] = self.store.get(key)
                    self._present.add(key)
            bodies = [self._open(key, raws[key], queued=False) if key in raws else None for key in keys]
        return [default if body is None else json.loads(body) for body in bodies]

    def _read_present(self, keys: list[str]) -> dict[str, bytes]:
        """{key: raw value} of `keys`, which existed before, in two round trips; {} (and forgotten) when
        one is gone."""
        try:
            if keys and self.store.check(keys):
                return dict(zip(keys, self.store.multi_get(keys), strict=True))
        except dist.DistStoreError as err:
            log.warning("a store key vanished while the controller read it (%s); reading key by key", err)
        self._present.difference_update(keys)
        return {}

    def set_plan(self, plan: dict) -> None:
        """The controller publishes a checkpoint plan: the sealed body, then its counter, in that
        order, so that a rank that sees the new count reads a body at least that new."""
        self.set_json(PLAN, plan)
        with self._lock:
            self.store.add(PLAN_SETS, 1)

    def plan_sets(self) -> int:
        """How many times the plan was set: one round trip that never blocks (`add` of 0). Not
        sealed (a TCPStore counter cannot be): a forged count only makes a rank re-read the
        sealed body, which it opens before trusting."""
        with self._lock:
            return self.store.add(PLAN_SETS, 0)

    def request_abort(self) -> None:
        self.set_json(ABORT, 1)

    def abort_requested(self) -> bool:
        return self.get_json(ABORT) == 1

    def _open(self, key: str, raw: bytes, *, queued: bool) -> str | None:
        try:
            return self._seal.open(key, raw, queued=queued)
        except Rejected as err:
            if queued or self._dropped.get(key) != raw:  # a key is re-read: count each value once
                self._dropped[key] = raw
                self._count(channel_of(key), str(err))
            return None

    def _count(self, channel: str, reason: str) -> None:
        self._rejections.count(channel, reason, "a rank" if self._on_rank else "the controller")
        if self._on_rank:  # the controller counts it too (the notice is sealed like any other event)
            self.push_event({"type": REJECTED, "channel": channel, "reason": reason})


def _json_object(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def connect(address: StoreAddress, gen: int, timeout_s: float = 60.0) -> GenerationStore:
    """Rank side: a client of the controller's store, scoped to generation `gen`."""
    client = dist.TCPStore(address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return GenerationStore(dist.PrefixStore(key_prefix(address.secret, gen), client), Seal(address.secret, gen))
