"""The error of a job the cluster cannot place or run its ranks for: fatal, retrying will not help."""

from __future__ import annotations


class PlacementError(RuntimeError):
    """The cluster cannot place the job's ranks (fatal: retrying will not help); the controller fails the
    job with its message, no traceback (orchestrator.controller.machine)."""
