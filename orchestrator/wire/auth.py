"""Authentication of control messages: an HMAC-SHA256 tag under a per-job secret.

Anyone who reaches the store's port can write any key of it (a TCPStore has no access
control). So every value the controller or a rank writes for the other side to act on (the
event queue, the abort key, the checkpoint plan, heartbeats) is sealed, and every reader
opens it before trusting a byte of it; a value that does not open is dropped and counted
(`Rejections`). torch's own process-group bootstrap keys (`pg/...`) cannot be sealed: see
docs/design.md, "The control plane's security model".

Where the keys are: every generation's keys live under `key_prefix(secret, gen)`, an HMAC
of the generation under the secret, so a client without the secret cannot guess one. It can
still learn them: torch 2.13's TCPStore answers `list_keys` to any client. So whoever reaches
the port can write torch's bootstrap keys (which cannot be sealed) and delete, overwrite or
pop the sealed ones (a denial of service), but forge nothing: docs/design.md, "The control
plane's security model".

The secret: `new_secret()` draws 32 random bytes once per job in the controller's process
(orchestrator.wire.store.RendezvousServer); it reaches the rank actors only as an argument
of their `join` call, through Ray, inside a `StoreAddress` whose repr leaves it out. It is
never logged, printed, written to a file, a report or a manifest.

A sealed value (ASCII, as a TCPStore value):

    <tag: 64 hex>:<sender: 16 hex>:<seq>:<body>
    tag = HMAC-SHA256(secret, "<gen>\\n<key>\\n<sender>\\n<seq>\\n<body>")

`gen` and `key` are signed but not sent: a value captured in one generation or under one key
(hb/0) does not open in another (generation 4, hb/1). `sender` is a random id per sealing
`Seal` (one per store client) and `seq` counts that sender's values of that key from 0, so a
reader refuses a queued value it has already taken (seq must grow) and a key value older than
one it has read (seq must not shrink): a captured message cannot be replayed. On a queue a
sender's seqs are consecutive, so one that jumps says how many of that sender's messages before
it never arrived: taken off the queue by another client, or sealed for a push that failed.
`Seal.open` adds them up (`take_missing`) and the store counts them as missing
(`Rejections.count_missing`), apart from rejected ones. A gap shows only when a later message
of the same sender arrives: a sender's last message taken away is not seen.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SECRET_BYTES = 32
_TAG_HEX = 64


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def key_prefix(secret: bytes, gen: int) -> str:
    """Generation `gen`'s key prefix in the store: `gen<g>-` and 128 bits only the secret gives."""
    return f"gen{gen}-" + hmac.new(secret, f"key prefix\n{gen}".encode(), hashlib.sha256).hexdigest()[:32]


_GENERATION = re.compile(r"gen(\d+)-")


def generation_of_key(secret: bytes, key: str) -> int | None:
    """The generation of a store key under its `key_prefix`; None for a key of no generation of
    this secret's job."""
    match = _GENERATION.match(key)
    if match is None:
        return None
    gen = int(match.group(1))
    return gen if key.startswith(key_prefix(secret, gen) + "/") else None


@dataclass(frozen=True)
class StoreAddress:
    """Where ranks reach the controller's store, and the job's secret (left out of the repr)."""

    host: str
    port: int
    secret: bytes = field(repr=False)


class Rejected(ValueError):
    """A value that does not open; the message names the reason only, never the contents."""


def channel_of(key: str) -> str:
    """The metric label of a key: `hb/<rank>` is "heartbeat", every other key is its own name."""
    return "heartbeat" if key.startswith("hb/") else key


class Seal:
    """Seals and opens the values of one generation for one store client.

    Thread-safety: `seal` and `open` are safe from any thread; the caller keeps the order of
    its sealed queue values equal to their push order (orchestrator.wire.store holds a lock)."""

    def __init__(self, secret: bytes, gen: int):
        self._secret, self._gen = secret, gen
        self.sender = secrets.token_hex(8)
        self._next: dict[str, int] = {}  # key -> this sender's next seq for it
        self._floors: dict[tuple[str, str], int] = {}  # (key, sender) -> newest seq opened
        self._lock = threading.Lock()
        self.missing = 0  # queued values skipped over (seq gaps), since the last `take_missing`

    def _tag(self, key: str, sender: str, seq: str, body: str) -> str:
        signed = f"{self._gen}\n{key}\n{sender}\n{seq}\n{body}".encode()
        return hmac.new(self._secret, signed, hashlib.sha256).hexdigest()

    def seal(self, key: str, body: str) -> str:
        """`body` sealed for `key`, with this sender's next seq for the key. A queued value sealed here
        and never pushed leaves a gap the reader counts as missing: seal right before the push."""
        with self._lock:
            number = self._next.get(key, 0)
            self._next[key] = number + 1
        seq = str(number)
        return f"{self._tag(key, self.sender, seq, body)}:{self.sender}:{seq}:{body}"

    def open(self, key: str, raw: bytes | str, *, queued: bool) -> str:
        """The body of a sealed value of `key`, or Rejected(reason). `queued`: a queue value,
        which is taken once (its seq must be new); a key value may be read again."""
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
            tag, sender, seq, body = text.split(":", 3)
            number = int(seq)
            expected = self._tag(key, sender, seq, body)  # (a lone surrogate does not encode: no tag either)
        except ValueError:
            raise Rejected("no tag") from None
        # As bytes: compare_digest raises TypeError on a str with a non-ASCII character, which a stranger
        # writing a tag of 64 such characters would turn from a rejection into an error that ends the job.
        if len(tag) != _TAG_HEX or not hmac.compare_digest(tag.encode("utf-8", "surrogatepass"), expected.encode()):
            raise Rejected("invalid tag")
        with self._lock:
            floor = self._floors.get((key, sender), -1)
            if number < floor or (queued and number == floor):
                raise Rejected("replayed")
            if queued:
                self.missing += number - floor - 1
            self._floors[(key, sender)] = number
        return body

    def take_missing(self) -> int:
        """Queued values found missing (seq gaps) since the last call."""
        with self._lock:
            missing, self.missing = self.missing, 0
        return missing


class Rejections:
    """Counts the control messages that did not open, by channel; logs the first of each
    channel once (the reason, never the contents: nothing of it is trusted).

    `on_reject(channel)` is called for each (the controller passes its metrics'
    `on_control_rejected`); `counts` keeps the totals; `missing` those of `count_missing`.
    Thread-safe."""

    def __init__(self, on_reject: Callable[[str], None] | None = None,
                 on_missing: Callable[[str, int], None] | None = None):
        self.on_reject, self.on_missing = on_reject, on_missing
        self.counts: Counter[str] = Counter()
        self.missing: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count_missing(self, channel: str, n: int) -> None:
        """`n` queued messages on `channel` never arrived (seq gaps: taken off the queue by another
        client, or a push that failed); `on_missing(channel, n)` is called, the first logged."""
        with self._lock:
            first = not self.missing[channel]
            self.missing[channel] += n
        if first:
            log.warning("control store: %d message(s) on %r never reached the controller (taken off the queue by "
                        "another client, or a push that failed). Further ones are counted in "
                        "undying_control_messages_missing_total.", n, channel)
        if self.on_missing is not None:
            self.on_missing(channel, n)

    def count(self, channel: str, reason: str, where: str = "the controller") -> None:
        with self._lock:
            self.counts[channel] += 1
            first = self.counts[channel] == 1
        if first:
            log.warning("control store: %s dropped a message on %r (%s); its contents are not trusted. "
                        "Further ones are counted in undying_control_messages_rejected_total.",
                        where, channel, reason)
        if self.on_reject is not None:
            self.on_reject(channel)
