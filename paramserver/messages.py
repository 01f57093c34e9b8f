"""What travels between workers and servers: one pull answer and one push per (worker, server, step).

Tensors are indexed by the slice's position in the server's shard (paramserver.partition), so
neither side sends names. A sparse entry is (rows, values): rows are global row indices of the
logical tensor, values the matching rows. `nbytes` is what the byte counters add up (the
payload; Ray's framing is not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _bytes(dense: dict[int, torch.Tensor], sparse: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
    total = sum(t.numel() * t.element_size() for t in dense.values())
    return total + sum(r.numel() * r.element_size() + v.numel() * v.element_size() for r, v in sparse.values())


@dataclass
class Pulled:
    """A server's answer to a pull: its parameters at `version`."""

    server: int
    version: int
    slowest: int  # the slowest worker's clock when the read was granted
    dense: dict[int, torch.Tensor] = field(default_factory=dict)
    sparse: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return _bytes(self.dense, self.sparse)


@dataclass
class Push:
    """One worker's gradient for one server's shard at one step.

    Gradients are sums over the worker's loss tokens (not means): the server divides by the
    token count it aggregates (bsp: all workers' tokens of the step, so the update is exactly
    collective dp's token-weighted mean; ssp and asp: this push's `tokens`)."""

    worker: int
    step: int
    pulled_version: int
    slowest_at_pull: int
    tokens: int
    dense: dict[int, torch.Tensor] = field(default_factory=dict)
    sparse: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return _bytes(self.dense, self.sparse)
