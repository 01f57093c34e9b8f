"""A user mistake in a job spec, and the error that carries all of them.

Every check of user input (spec sections, cross-section rules, overrides, storage, cluster
capacity) reports `Problem`s; the CLI prints them all, one line each, and exits 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One user mistake: `field` is a dotted path into the spec (or the file or `--set`
    the mistake is in); `message` says what is wrong and how to fix it, on one line."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(Exception):
    """The job spec cannot run as written. `problems` lists every mistake found;
    `str()` gives one line per problem."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
