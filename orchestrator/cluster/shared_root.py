"""Every rank sees the checkpoint root the driver claimed: a file:// root must be one filesystem.

A plain path is natural for a checkpoint root (`file:///mnt/lustre/ckpt`, and the examples'
`file:///tmp/undying/ckpt` on a laptop). On a cluster of several nodes it must be a filesystem every
node mounts at that path; one that only the driver's node has (its /tmp) takes each other node's
shards onto that node's own disk, where no commit finds them: every save fails, hours of training
are checkpointed nowhere, and the error names missing shards, not the mount.

Protocol: `RayWorkerGroup` takes `root_proof(spec)` once (the driver holds the root's owner lease by
then: the proof is its claim file and token, ckpt.owner_claims.visibility_proof) and gives it to
every rank actor it creates; the actor's `ping` answers `sees_root` (ckpt.owner_claims.sees_claim),
and the group raises `RootNotShared` for an actor that does not, whichever call pinged it (the
placement, a replacement, a spare's warm-up). The controller fails the job with its message
(a PlacementError).
"""

from __future__ import annotations

import logging

from ckpt.owner_claims import visibility_proof
from ckpt.storage import Storage
from orchestrator.cluster.placement_error import PlacementError

log = logging.getLogger(__name__)


class RootNotShared(PlacementError):
    """A rank actor does not see the checkpoint root the driver claimed: the job cannot save."""

    def __init__(self, root: str, node: str, claim: str):
        super().__init__(f"checkpoint.url {root}: the rank actor on node {node[:12]} does not see the driver's claim "
                         f"{claim} there, so this path is another folder on that node and no save of its ranks "
                         "could commit; use a filesystem every node mounts at this path (NFS, Lustre, a shared "
                         "volume), or an object store (s3://)")


def root_proof(spec) -> tuple[str, str] | None:
    """What each rank checks it sees (None: nothing to check: an object store, or no claim yet)."""
    try:
        return visibility_proof(Storage(spec.checkpoint_root, spec.checkpoint.storage_options))
    except Exception as err:  # noqa: BLE001 (a failing store: the commits will say so; the check is an aid)
        log.warning("could not read the owner claim of %s to check every node sees it: %s", spec.checkpoint_root, err)
        return None
