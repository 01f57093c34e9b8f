"""Which ranks are blocked on a checkpoint save, and whether that save is moving: the hang
watchdog's exception for long saves.

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


@dataclass
class _Seen:
    beat: Heartbeat
    changed_at: float  # when the controller last saw this rank's beat change (its time moved)
    moved_at: float  # when it last saw the rank's saved bytes move


class SaveWatch:
    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}

    def reset(self) -> None:
        self._seen.clear()

    def observe(self, rank: int, beat: Heartbeat, now: float) -> None:
        old = self._seen.get(rank)
        if old is None:
            self._seen[rank] = _Seen(beat, now, now)
            return
        changed = now if beat.time != old.beat.time else old.changed_at
        moved = now if beat.saved_bytes != old.beat.saved_bytes else old.moved_at
        self._seen[rank] = _Seen(beat, changed, moved)

    def _savers(self, now: float, limit_s: float) -> dict[int, _Seen]:
        """Ranks whose latest beat says they are blocked on a save, and that beat within the limit."""
        return {rank: seen for rank, seen in self._seen.items()
                if seen.beat.saving is not None and now - seen.changed_at < limit_s}

    def busy(self, limit_s: float, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return any(now - seen.moved_at < stall_s(limit_s) for seen in self._savers(now, limit_s).values())

    def stalled(self, limit_s: float, now: float | None = None) -> str | None:
        """Why the ranks blocked on a save are no excuse (their save wrote nothing for `stall_s`), or
        None when no rank is blocked on a save."""
        now = time.monotonic() if now is None else now
        savers = self._savers(now, limit_s)
        if not savers:
            return None
        steps = sorted({seen.beat.saving for seen in savers.values()})
        quiet = min(now - seen.moved_at for seen in savers.values())
        return (f"rank(s) {sorted(savers)} blocked on the save of step(s) {steps} wrote nothing for {quiet:.0f} s "
                f"(a save stalls after {stall_s(limit_s):.0f} s without a byte written)")
