"""The driver's owner lease on its job's checkpoint root (ckpt.ownership), for `undying run`.

Called by orchestrator.cli.run and orchestrator.cli.ps_run after Ray is up and before anything
writes to the root; the caller releases the lease last, however the job ends.
"""

from __future__ import annotations

import sys

from ckpt.ownership import OwnerAlive, OwnerLease
from ckpt.storage import Storage


def claim_root(spec) -> OwnerLease | None:
    """The lease on `spec`'s checkpoint root; None, with the reason printed, while another job owns it
    (the caller exits 2: nothing was started)."""
    storage = Storage(spec.checkpoint_root, spec.checkpoint.storage_options)
    try:
        return OwnerLease.claim(storage, f"undying run of job {spec.name!r}", spec.checkpoint.owner_lease_s,
                                say=lambda line: print(f"undying: {line}", flush=True))
    except OwnerAlive as err:
        print(f"undying: the job cannot start: {err}", file=sys.stderr)
        return None
