"""A `Storage` that records every range read, to assert which bytes a restore fetched."""

from __future__ import annotations

import threading

from ckpt.storage import Storage


class CountingStorage(Storage):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.reads: list[tuple[str, int, int]] = []  # (file name, start, end)
        self._lock = threading.Lock()  # the reader fetches from a thread pool

    def read_range_into(self, path: str, start: int, out: memoryview) -> int:
        # The reader's one entry point (ckpt.fetch); on stores other than file:// it calls
        # read_range, which is therefore not counted again.
        with self._lock:
            self.reads.append((path.rsplit("/", 1)[-1], start, start + len(out)))
        return super().read_range_into(path, start, out)

    @property
    def bytes_read(self) -> int:
        return sum(end - start for _, start, end in self.reads)
