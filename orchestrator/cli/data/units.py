"""Splitting the inputs into work units: a pure function of the sources and a size budget.

Called once by the driver (`plan.make_plan`). A unit is a run of consecutive pieces of the
input stream (files in the order given, records in file order) whose text adds up to about
`budget` bytes; one task tokenizes it and writes it as shard `index`. Because units are cut
in stream order and each shard is named by its unit's index, the shards concatenated in
index order hold the documents in input order however many tasks run at once.

Small files share a unit (many small .txt files do not become many tiny shards); a .jsonl
file is cut at any byte (records belong to the piece their line starts in, see
`records.py`); a parquet file between row groups; a .txt or .arrow file never, so one larger
than the budget is a unit of its own, and so is a single oversized row group.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from orchestrator.cli.data.sources import Source

# The budget is in tokens (--shard-tokens); the inputs are measured in bytes before any
# tokenization, at about four bytes of text per token (typical of BPE vocabularies on English).
BYTES_PER_TOKEN = 4


class Piece(BaseModel):
    """Part of one file: `source` and `file` index the sources and their files; [start, stop)
    is a byte range (.jsonl), a row-group range (.parquet) or [0, 1), the whole file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: int
    file: int
    start: int
    stop: int


class Unit(BaseModel):
    """What one task tokenizes and writes as shard `index`: `pieces` in stream order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    pieces: tuple[Piece, ...]
    est_bytes: int


class _Packer:
    """Accumulates pieces into the current unit and closes it once it reaches the budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.units: list[Unit] = []
        self.pieces: list[Piece] = []
        self.used = 0

    def room(self) -> int:
        return self.budget - self.used

    def add(self, piece: Piece, size: int) -> None:
        last = self.pieces[-1] if self.pieces else None
        if last and (last.source, last.file, last.stop) == (piece.source, piece.file, piece.start):
            self.pieces[-1] = last.model_copy(update={"stop": piece.stop})  # contiguous: one read
        else:
            self.pieces.append(piece)
        self.used += size
        if self.used >= self.budget:
            self.close()

    def close(self) -> None:
        if self.pieces:
            self.units.append(Unit(index=len(self.units), pieces=tuple(self.pieces), est_bytes=self.used))
        self.pieces, self.used = [], 0


def plan_units(sources: list[Source], budget_bytes: int) -> list[Unit]:
    """The work units of `sources`, in stream order, each of about `budget_bytes` of text."""
    assert budget_bytes > 0
    packer = _Packer(budget_bytes)
    for s, source in enumerate(sources):
        for f, file in enumerate(source.files):
            if source.kind == "jsonl":
                pos = 0
                while pos < file.size:
                    take = min(file.size - pos, packer.room())
                    packer.add(Piece(source=s, file=f, start=pos, stop=pos + take), take)
                    pos += take
            else:
                for i, size in enumerate(file.atoms):
                    packer.add(Piece(source=s, file=f, start=i, stop=i + 1), size)
    packer.close()
    return packer.units
