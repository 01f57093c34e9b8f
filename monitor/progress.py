"""Progress of a long operation on stderr: a tqdm bar on a terminal, plain lines otherwise.

A bar redraws in place, which only a terminal shows well; in a log (CI, `kubectl logs`, a file)
it would be one endless line of carriage returns, so there a line such as

    undying ckpt verify step 40: 1.2 GiB of 4.0 GiB (30%), 12 s

is printed every `every_s` seconds instead (nothing for an operation shorter than that).

Used by the CLI (`ckpt verify`, `ckpt export`, `data prepare`) and by rank 0 during a restore
from storage (a rank's stderr is never a terminal: Ray forwards its lines to the driver's log).

Protocol: the caller creates one `Progress` per operation and uses it as a context manager;
`advance(n, total)` is called on one thread (the command's) as work is done (`total`, when the
worker knows it only once it starts, may be given with the first call); leaving the block
removes the bar. Stdout is never written, so a command's `--json` output stays parseable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

PLAIN_EVERY_S = 10.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Bytes (`unit="B"`) or items (any other unit, e.g. "shards") done of `total` for `label`."""

    def __init__(self, label: str, total: float | None = None, *, unit: str = "B", stream: TextIO | None = None,
                 every_s: float | None = None, clock: Callable[[], float] = time.monotonic, enabled: bool = True):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = PLAIN_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.enabled = enabled  # False: shows nothing (a rank other than 0)
        self.done = 0.0
        self.note = ""
        self._bar = None
        self._started = self._printed = clock()

    def __enter__(self) -> Progress:
        isatty = getattr(self.stream, "isatty", None)
        if self.enabled and isatty is not None and isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.label, unit=self.unit, unit_scale=self.unit == "B",
                             unit_divisor=1024, file=self.stream, leave=False, dynamic_ncols=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()

    def advance(self, n: float, total: float | None = None, note: str | None = None) -> None:
        """`n` more done; `total` sets the total when given; `note` is shown after the counts."""
        if not self.enabled:
            return
        self.done += n
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:  # redrawn with the total (the bar starts without one)
                done = self._bar.n
                self._bar.reset(total=total)
                self._bar.update(done)
        if note is not None:
            self.note = note
            if self._bar is not None:
                self._bar.set_postfix_str(note, refresh=False)
        if self._bar is not None:
            self._bar.update(n)
        elif self.clock() - self._printed >= self.every_s:
            self._printed = self.clock()
            print(self.line(), file=self.stream, flush=True)

    def line(self) -> str:
        """The plain line: counts, share of the total, seconds so far, and the note."""
        count = human_bytes if self.unit == "B" else (lambda v: f"{v:,.0f}")
        of = f" of {count(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        unit = "" if self.unit == "B" else f" {self.unit}"
        note = f", {self.note}" if self.note else ""
        return f"{self.label}: {count(self.done)}{of}{unit}, {self.clock() - self._started:.0f} s{note}"
