"""Every step's record, kept in columns: what the report's loss curve, the lost-work accounting and
the background cost of saves read.

A multi-day job runs 10^5 to 10^6 steps. A dataclass per step held in a dict cost the controller
about 270 bytes a step (274 MB at 10^6, measured with tracemalloc); these five float64 columns
and a presence byte cost 41. Steps are indexed by number from the lowest one recorded (a job
resumed at step 900,000 holds no columns for the steps before), so a rollback's redone steps land
in place and a range of steps is read without a scan of the rest.

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
        self._present = bytearray()  # index i holds step _base + i
        self._base = 0
        self._count = 0

    def put(self, record: StepRecord) -> None:
        """Record `record`, replacing an earlier record of its step."""
        if record.step < 0:
            raise ValueError(f"step {record.step}: steps are numbered from 0")
        if not self._present:
            self._base = record.step
        elif record.step < self._base:  # a rollback behind the first step recorded: rare, so a copy
            grow = self._base - record.step
            self._present[:0] = bytes(grow)
            for name, column in self._columns.items():
                self._columns[name] = array("d", bytes(8 * grow)) + column
            self._base = record.step
        index = record.step - self._base
        if index >= len(self._present):
            grow = index + 1 - len(self._present)
            self._present.extend(bytes(grow))
            for column in self._columns.values():
                column.frombytes(bytes(8 * grow))  # zero bytes are 0.0
        if not self._present[index]:
            self._present[index] = 1
            self._count += 1
        for name in _COLUMNS:
            self._columns[name][index] = float(getattr(record, name))

    def _index(self, step: object) -> int | None:
        """The column index of recorded step `step`, None when it is not recorded."""
        if not isinstance(step, int):
            return None
        index = step - self._base
        return index if 0 <= index < len(self._present) and self._present[index] else None

    def __getitem__(self, step: int) -> StepRecord:
        i = self._index(step)
        if i is None:
            raise KeyError(step)
        c = self._columns
        return StepRecord(step, c["loss"][i], int(c["tokens"][i]), c["step_s"][i], c["time"][i], c["data_wait_s"][i])

    def __contains__(self, step: object) -> bool:
        return self._index(step) is not None

    def __iter__(self) -> Iterator[int]:
        """Recorded step numbers, in step order."""
        present, base = self._present, self._base
        return (base + i for i in range(len(present)) if present[i])

    def __len__(self) -> int:
        return self._count

    def records(self, start: int = 0) -> Iterator[StepRecord]:
        """The records of the steps from `start` on, in step order: the cost is that range's, not the job's."""
        present, base = self._present, self._base
        return (self[base + i] for i in range(max(0, start - base), len(present)) if present[i])

    def newest(self) -> int | None:
        """The highest recorded step, None before the first."""
        present = self._present
        return next((self._base + i for i in range(len(present) - 1, -1, -1) if present[i]), None)

    def totals(self) -> tuple[float, int]:
        """(seconds, tokens) summed over every recorded step."""
        present, seconds, tokens = self._present, self._columns["step_s"], self._columns["tokens"]
        return (sum(seconds[s] for s in range(len(present)) if present[s]),
                int(sum(tokens[s] for s in range(len(present)) if present[s])))
