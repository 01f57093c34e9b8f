"""Do a tensor's stored chunks tile it exactly? The commit-time check behind invariant 1.

Called by `ckpt.manifest.merge_receipts` (controller, before a manifest is created) for
every logical tensor. A manifest that leaves an element unstored, or stores one twice,
would load garbage or load ambiguously later; it is refused here with a message that
names the tensor and the offending chunks, so the save is dropped and the bug is visible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ckpt.boxes import Ints, describe, inside, intersect, volume
from ckpt.errors import IncompleteCheckpoint

_EXAMPLE_LIMIT = 1 << 24  # elements: above this, a gap is reported by count without locating it


def check_coverage(name: str, shape: Ints, chunks: Sequence[tuple[Ints, Ints, str]]) -> None:
    """Raise IncompleteCheckpoint unless the boxes `(offsets, lengths, file)` tile `shape` exactly.

    Disjoint boxes inside the tensor whose volumes add up to its volume cover it exactly,
    so the check is bounds + pairwise disjointness (a sweep along dimension 0) + volume.
    """
    for offsets, lengths, file in chunks:
        if not inside(offsets, lengths, shape):
            raise IncompleteCheckpoint(f"{name}: chunk {describe(offsets, lengths)} in {file} lies outside "
                                       f"the tensor's shape {list(shape)}")
    boxes = sorted((c for c in chunks if volume(c[1]) > 0), key=lambda c: tuple(c[0]))
    for i, (a_off, a_len, a_file) in enumerate(boxes):
        a_end = a_off[0] + a_len[0] if a_off else None
        for b_off, b_len, b_file in boxes[i + 1:]:
            if a_end is not None and b_off[0] >= a_end:
                break  # sorted by start along dim 0: no later box reaches back into this one
            if intersect(a_off, a_len, b_off, b_len) is not None:
                what = "written twice" if (a_off, a_len) == (b_off, b_len) else "overlapping"
                raise IncompleteCheckpoint(
                    f"{name}: {what}: chunk {describe(a_off, a_len)} in {a_file} and chunk "
                    f"{describe(b_off, b_len)} in {b_file}"
                )
    stored, total = sum(volume(c[1]) for c in boxes), volume(shape)
    if stored != total:
        raise IncompleteCheckpoint(f"{name}: the chunks cover {stored} of {total} elements"
                                   f"{_first_gap(shape, boxes)}; no rank wrote the rest")


def _first_gap(shape: Ints, boxes: list) -> str:
    if volume(shape) > _EXAMPLE_LIMIT:
        return ""
    covered = np.zeros(tuple(shape), dtype=bool)
    for offsets, lengths, _ in boxes:
        covered[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))] = True
    missing = np.argwhere(~covered)
    return f" (element {tuple(int(i) for i in missing[0])} is missing)" if len(missing) else ""
