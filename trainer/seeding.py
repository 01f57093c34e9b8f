"""Counter-based seeds: every random draw in training is a pure function of named counters.

Nothing in the trainer keeps random state from one step to the next. The data cursor seeds
a generator from (seed, step, index), the model seeds each parameter from (seed, name), and
the engine reseeds dropout from (seed, step, dp_rank). A resumed run therefore needs no RNG
state in its checkpoint, and a rank can compute any sample without computing the ones before.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends only on `parts`, identical in every process and platform.

    Python's built-in `hash()` of a string is randomised per process (PYTHONHASHSEED), so a
    cryptographic digest is used instead; 63 bits keeps the value a valid `manual_seed`.
    """
    text = "/".join(str(part) for part in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: int | str) -> torch.Generator:
    """A fresh CPU generator seeded from `parts`; it never touches the global RNG."""
    return torch.Generator(device="cpu").manual_seed(derive_seed(*parts))
