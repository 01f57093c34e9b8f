"""Rank timestamps moved onto the controller's wall clock before any interval uses them.

A rank stamps its step records, fault notices and node-loss reports with its own host's
`time.time()`; the controller subtracts such times from its own (detection time, lost work,
which faults fired before a failure). Two hosts' wall clocks differ by their NTP error, or by
anything after a step of one of them, so no interval may subtract them as they are.

What one-way messages prove: a message is received after it was sent. The controller's
reading at receipt bounds the sending time on its own clock, so each rank's clock is ahead by
at least max(sent - received) over its messages; `ClockSkew` keeps that bound per rank and
takes it off every timestamp of that rank. On one host the bound is 0 and times pass unchanged;
a rank whose clock runs ahead has its times moved back to within one message latency of the
truth, so no event of it lands after the controller saw it. A clock that runs behind cannot be
told from a slow message without a round trip; its intervals read long by the lag (never
negative, never reordered against receipt).

Protocol (controller thread only): `EventIntake.drain` passes every message from the ranks'
queue through `to_local` as it arrives, before any handler sees it, and calls `reset` at its
first drain of a new generation's store (the bounds are per rank index, and an index can move
to another host between generations).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from orchestrator.wire.messages import FaultFired, NodeLost, StepDone


class ClockSkew:
    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.ahead_s: dict[int, float] = {}  # rank -> proven lower bound of how far its clock is ahead

    def reset(self) -> None:
        """A new generation: a rank index may now be on another host (a spare, a drain, a
        shrink), whose clock owes nothing to the old one's bound."""
        self.ahead_s.clear()

    def local(self, rank: int, sent: float, received: float) -> float:
        """`sent` (rank `rank`'s clock) on the controller's clock, given the controller's `received`."""
        ahead = max(self.ahead_s.get(rank, 0.0), sent - received)
        self.ahead_s[rank] = ahead
        return sent - ahead

    def to_local(self, message, received: float | None = None):
        """`message` with its rank timestamp on the controller's clock (other messages unchanged)."""
        if isinstance(message, StepDone):
            rank = 0  # step records come from rank 0
        elif isinstance(message, (FaultFired, NodeLost)) and message.rank is not None:
            rank = message.rank
        else:
            return message
        if message.time is None:
            return message
        received = self.clock() if received is None else received
        return dataclasses.replace(message, time=self.local(rank, message.time, received))
