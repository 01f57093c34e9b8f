"""The rendezvous store, hosted by the controller, and the per-generation key space.

The controller owns one `torch.distributed.TCPStore` server for the life of the job, so
losing any rank never loses the store (docs/design.md section 2). Each membership generation
uses the key prefix `gen<g>`: process-group bootstrap keys, the abort flag, the checkpoint
plan, heartbeats and the event queue. Messages of an old generation live under an old
prefix and are never read again.

Key space under `gen<g>/` (who writes -> who reads):
  pg/...         torch.distributed bootstrap (ranks -> ranks)
  abort          "1" when the controller wants every rank out (controller -> ranks)
  plan           checkpoint plan JSON (controller -> ranks, polled at the heartbeat rate)
  hb/<rank>      last heartbeat JSON of a rank (rank -> controller)
  events         queue of JSON events: step records, shard receipts, fault notices (ranks -> controller)
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import torch.distributed as dist

from orchestrator.wire.messages import Message, decode, encode

log = logging.getLogger(__name__)

EVENTS = "events"
ABORT = "abort"
PLAN = "plan"


def heartbeat_key(rank: int) -> str:
    return f"hb/{rank}"


class RendezvousServer:
    """Controller side. Create once per job; `generation(g)` gives that generation's key space."""

    def __init__(self, host: str, port: int = 0):
        self.host = host
        self._server = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.port = self._server.port

    def generation(self, gen: int) -> GenerationStore:
        return GenerationStore(dist.PrefixStore(f"gen{gen}", self._server))


class GenerationStore:
    """One generation's key space; used by the controller and (through `connect`) by ranks.

    Thread-safety: one instance per thread; each `connect` opens its own client connection.
    """

    def __init__(self, store: dist.Store):
        self.store = store

    def pg_store(self) -> dist.Store:
        return dist.PrefixStore("pg", self.store)

    def push_event(self, event: dict) -> None:
        self.store.queue_push(EVENTS, json.dumps(event))

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
        """Every queued event, oldest first, without blocking."""
        out: list[dict] = []
        pending = self.store.queue_len(EVENTS)
        for _ in range(min(pending, limit)):
            out.append(json.loads(self.store.queue_pop(EVENTS, block=False)))
        return out

    def set_json(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get_json(self, key: str, default=None):
        # TCPStore.get blocks until the key exists: check first.
        if not self.store.check([key]):
            return default
        return json.loads(self.store.get(key))

    def request_abort(self) -> None:
        self.store.set(ABORT, "1")

    def abort_requested(self) -> bool:
        return self.store.check([ABORT])


def connect(host: str, port: int, gen: int, timeout_s: float = 60.0) -> GenerationStore:
    """Rank side: a client of the controller's store, scoped to generation `gen`."""
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return GenerationStore(dist.PrefixStore(f"gen{gen}", client))
