"""Rectangles ("boxes") inside row-major tensors: the geometry shared by commit checks and reshard plans.

A box is `(offsets, lengths)`, one entry per dimension; a 0-d tensor (scalar) has the
empty box `((), ())`, whose volume is 1. All functions are pure and work on plain tuples,
so the planners that use them can be tested on metadata alone.
"""

from __future__ import annotations

from collections.abc import Sequence

Ints = Sequence[int]


def volume(lengths: Ints) -> int:
    count = 1
    for length in lengths:
        count *= length
    return count


def row_major_strides(shape: Ints) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of `shape`."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def intersect(a_off: Ints, a_len: Ints, b_off: Ints, b_len: Ints) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The common box of two boxes of the same tensor, or None when they share no element."""
    offsets, lengths = [], []
    for a0, an, b0, bn in zip(a_off, a_len, b_off, b_len, strict=True):
        start, end = max(a0, b0), min(a0 + an, b0 + bn)
        if end <= start:
            return None
        offsets.append(start)
        lengths.append(end - start)
    return tuple(offsets), tuple(lengths)


def inside(off: Ints, lengths: Ints, shape: Ints) -> bool:
    """Whether the box lies within a tensor of `shape` (same number of dimensions)."""
    if not len(off) == len(lengths) == len(shape):
        return False
    return all(o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(off, lengths, shape, strict=True))


def relative(off: Ints, origin: Ints) -> tuple[int, ...]:
    """`off` expressed relative to a box starting at `origin`."""
    return tuple(o - g for o, g in zip(off, origin, strict=True))


def describe(off: Ints, lengths: Ints) -> str:
    """A box for error messages: `[0:4, 8:16]`, or `[]` for a scalar."""
    if len(off) != len(lengths):  # a damaged manifest's
        return f"offsets {list(off)} lengths {list(lengths)}"
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, lengths, strict=True)) + "]"
