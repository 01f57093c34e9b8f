"""Which ranks are blocked on storage (a checkpoint save, a data read their store fails), and
whether that is moving: the hang watchdog's exceptions.

A rank's training thread blocks on a save at a stop step and at the final step (until its
shard is written), and behind a save still in flight when the next one is due (a slow store).
Meanwhile no step is reported, so by steps alone a save longer than the hang limit would look
like a hang and the job would kill healthy ranks mid-write: the stop's or the job's last
checkpoint lost. Such a rank keeps beating with `saving` set and the bytes its writers have
handed to the store (orchestrator.rank.beats).

Protocol (controller thread): `Telemetry.poll` feeds `observe(rank, beat, now)` with every
heartbeat it reads (now: time.monotonic()); `reset()` at a new layout. The watchdog asks
`busy(limit_s)` before it judges "no step for the limit" a hang: some rank is blocked on a save, beat within
the limit, and some such rank's bytes moved within `stall_s(limit_s)` (the longest one storage
call may take). Then it is a save, not a hang. Otherwise `stalled(limit_s)` says why the
savers are no excuse, for the hang's message. A save that stops moving is thus found after
`stall_s`, a SIGSTOPped rank as before (its beats stop), and a rank hung beside a saving peer
once that save ends.

A rank waiting for its next step's data beats with `data_wait_s`, the wait so far: its store may
be failing the reads, which wait an outage out for up to `data.read_retry_s` (trainer.tokens.reader,
after the client's own retries) and then fail the rank naming the store. Such a rank keeps the job
busy while it beats and its wait is within `data_outage_s(spec)` plus the limit; a read stuck past
that is a hang like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.wire.messages import Heartbeat

# One storage call (a multipart upload's part, a file's close) may take this long before a
# blocked save that writes nothing counts as stalled; the hang limit when that is longer.
SAVE_STALL_FLOOR_S = 120.0


def stall_s(limit_s: float) -> float:
    return max(SAVE_STALL_FLOOR_S, limit_s)


def data_outage_s(spec) -> float:
    """How long one rank may wait out its data store's outage (data.read_retry_s; prepared datasets
    only, the reads that are retried), its peers meanwhile in a collective."""
    data = getattr(spec, "data", None)
    return float(data.read_retry_s) if data is not None and data.source == "tokens" else 0.0


@dataclass
class _Seen:
    beat: Heartbeat
    changed_at: float  # when the controller last saw this rank's beat change (its time moved)
    moved_at: float  # when it last saw the rank's saved bytes move


class SaveWatch:
    def __init__(self, data_outage_s: float = 0.0) -> None:
        self._seen: dict[int, _Seen] = {}
        self.data_outage_s = data_outage_s

    def reset(self) -> None:
        self._seen.clear()

    def observe(self, rank: int, beat: Heartbeat, now: float) -> None:
        old = self._seen.get(rank)
        if old is None:
            self._seen[rank] = _Seen(beat, now, now)
            return
        changed = now if beat.time != old.beat.time else old.changed_at
        # A save's stall counts from its start (the rank blocking on another step), not from the bytes
        # of the save before, which may have ended long ago.
        moved = now if (beat.saved_bytes, beat.saving) != (old.beat.saved_bytes, old.beat.saving) else old.moved_at
        self._seen[rank] = _Seen(beat, changed, moved)

    def _savers(self, now: float, limit_s: float) -> dict[int, _Seen]:
        """Ranks whose latest beat says they are blocked on a save, and that beat within the limit."""
        return {rank: seen for rank, seen in self._seen.items()
                if seen.beat.saving is not None and now - seen.changed_at < limit_s}

    def busy(self, limit_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(self.reading(limit_s, now)) or \
            any(now - seen.moved_at < stall_s(limit_s) for seen in self._savers(now, limit_s).values())

    def reading(self, limit_s: float, now: float | None = None) -> dict[int, float]:
        """Ranks waiting for a step's data within an outage's allowance (rank -> for how long), by
        beats within the limit."""
        now = time.monotonic() if now is None else now
        return {rank: wait for rank, wait in self._data_waits(now, limit_s).items()
                if wait <= self.data_outage_s + limit_s}

    def _data_waits(self, now: float, limit_s: float) -> dict[int, float]:
        """Ranks whose latest beat, within the limit, says they wait for a step's data: rank -> the wait."""
        return {rank: seen.beat.data_wait_s for rank, seen in self._seen.items()
                if seen.beat.data_wait_s > 0 and now - seen.changed_at < limit_s}

    def stalled(self, limit_s: float, now: float | None = None) -> str | None:
        """Why the ranks blocked on storage are no excuse (a data wait past its allowance, a save that
        wrote nothing for `stall_s`), or None when no rank is blocked on storage."""
        now = time.monotonic() if now is None else now
        late = {rank: wait for rank, wait in self._data_waits(now, limit_s).items()
                if wait > self.data_outage_s + limit_s}
        if late:
            return (f"rank(s) {sorted(late)} waited {max(late.values()):.0f} s for a step's data, past the "
                    f"data store's outage allowance (data.read_retry_s={self.data_outage_s:g} s) and the limit")
        savers = self._savers(now, limit_s)
        if not savers:
            return None
        steps = sorted({seen.beat.saving for seen in savers.values()})
        quiet = min(now - seen.moved_at for seen in savers.values())
        return (f"rank(s) {sorted(savers)} blocked on the save of step(s) {steps} wrote nothing for {quiet:.0f} s "
                f"(a save stalls after {stall_s(limit_s):.0f} s without a byte written)")
