"""Errors from many ranks, collapsed into one readable line.

A failure on 512 ranks produces 512 tracebacks that differ only in addresses and ports;
the controller reports them as "[ranks 0-3,7]: RuntimeError: Connection reset by peer".
"""

from __future__ import annotations

import re

_ADDRESS = re.compile(r"\[?\b\d{1,3}(?:\.\d{1,3}){3}\]?(?::\d+)?|\[[0-9a-f:]+\](?::\d+)?")
_SOURCE = re.compile(r"\[/[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def normalise(error: str, limit: int = 100) -> str:
    """The exception text without addresses, ports and C++ source locations, on one line."""
    text = _SOURCE.sub("", error)
    text = _ADDRESS.sub("<addr>", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 7] -> "0-3,7"."""
    out: list[str] = []
    ranks = sorted(set(ranks))
    start = prev = None
    for rank in ranks + [None]:
        if rank is not None and prev is not None and rank == prev + 1:
            prev = rank
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = rank
    return ",".join(out)


def collapse(errors: dict[int, str]) -> str:
    """One clause per distinct (normalised) error, biggest group first."""
    groups: dict[str, list[int]] = {}
    for rank, error in errors.items():
        groups.setdefault(normalise(error), []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), min(item[1])))
    return "; ".join(
        f"[rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}]: {error}" for error, ranks in ordered
    )


# How a rank's collective fails when a peer failed first (its socket closed, the controller's abort,
# a communicator torn down): these ranks are victims, not the cause (orchestrator.controller.blame).
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport/",
                        "DistBackendError", "DistNetworkError", "abort requested by the controller",
                        "NCCL communicator was aborted")


def is_peer_failure(error: str) -> bool:
    """Whether a rank's error says only that a peer failed (see PEER_FAILURE_MARKERS)."""
    return any(marker in error for marker in PEER_FAILURE_MARKERS)
