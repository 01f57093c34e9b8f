"""Every step's record, kept in columns: what the report's loss curve, the lost-work accounting and
the background cost of saves read.

A multi-day job runs 10^5 to 10^6 steps. A dataclass per step held in a dict cost the controller
about 270 bytes a step (274 MB at 10^6, measured with tracemalloc); these five float64 columns
and a presence byte cost 41. Steps are indexed by number, so a resumed job's first step and a
rollback's redone ones land in place, and a range of steps is read without a scan of the rest.

Protocol: the controller thread only. `JobRecord.on_step` calls `put` for each step event (a redone
step replaces its record); readers use the read-only Mapping interface (`step in log`, `log[step]`,
iteration in step order) or `records(start)` for the steps from `start` on.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

_COLUMNS = ("loss", "tokens", "step_s", "time", "data_wait_s")


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens: int
    step_s: float
    time: float  # wall-clock time (time.time()) the step finished on rank 0
    data_wait_s: float = 0.0  # part of step_s rank 0 waited for its samples (booked as `data` badput)


class StepLog(Mapping[int, StepRecord]):
    def __init__(self) -> None:
        self._columns = {name: array("d") for name in _COLUMNS}
        self._present = bytearray()
        self._count = 0

    def put(self, record: StepRecord) -> None:
        """Record `record`, replacing an earlier record of its step."""
        step = record.step
        if step < 0:
            raise ValueError(f"step {step}: steps are numbered from 0")
        if step >= len(self._present):
            grow = step + 1 - len(self._present)
            self._present.extend(bytes(grow))
            for column in self._columns.values():
                column.extend([0.0] * grow)
        if not self._present[step]:
            self._present[step] = 1
            self._count += 1
        for name in _COLUMNS:
            self._columns[name][step] = float(getattr(record, name))

    def __getitem__(self, step: int) -> StepRecord:
        if not (isinstance(step, int) and 0 <= step < len(self._present) and self._present[step]):
            raise KeyError(step)
        c = self._columns
        return StepRecord(step, c["loss"][step], int(c["tokens"][step]), c["step_s"][step], c["time"][step],
                          c["data_wait_s"][step])

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and 0 <= step < len(self._present) and bool(self._present[step])

    def __iter__(self) -> Iterator[int]:
        """Recorded step numbers, in step order."""
        present = self._present
        return (step for step in range(len(present)) if present[step])

    def __len__(self) -> int:
        return self._count

    def records(self, start: int = 0) -> Iterator[StepRecord]:
        """The records of the steps from `start` on, in step order: the cost is that range's, not the job's."""
        present = self._present
        return (self[step] for step in range(max(0, start), len(present)) if present[step])

    def newest(self) -> int | None:
        """The highest recorded step, None before the first."""
        return next((step for step in range(len(self._present) - 1, -1, -1) if self._present[step]), None)

    def totals(self) -> tuple[float, int]:
        """(seconds, tokens) summed over every recorded step."""
        present, seconds, tokens = self._present, self._columns["step_s"], self._columns["tokens"]
        return (sum(seconds[s] for s in range(len(present)) if present[s]),
                int(sum(tokens[s] for s in range(len(present)) if present[s])))
