"""Controller side of checkpoints: commit manifests, find the latest committed one, retention.

Protocol: only the controller calls `commit`, after it holds one `ShardReceipt` from every
rank of the generation for that step. The manifest is created last and exclusively, so a
checkpoint either exists whole or not at all (design.md invariant 1). `committed_steps`
derives "latest" from committed manifests alone; a directory without a manifest is an
unfinished save, invisible to readers and removed by `collect_garbage`.
"""

from __future__ import annotations

import json
import logging
import time

from ckpt.manifest import MANIFEST_NAME, Manifest, ShardReceipt, merge_receipts, parse_step_dir, step_dir
from ckpt.storage import AlreadyCommitted, Storage

log = logging.getLogger(__name__)


class Catalog:
    """The checkpoints of one job under `<checkpoint.url>/<job name>`."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def manifest_path(self, step: int) -> str:
        return self.storage.path(step_dir(step), MANIFEST_NAME)

    def commit(
        self, *, job: str, step: int, generation: int, layout: dict, spec_hash: str,
        receipts: list[ShardReceipt], state: dict,
    ) -> Manifest:
        tensors = merge_receipts(receipts)
        manifest = Manifest(
            job=job, step=step, generation=generation, layout=layout, spec_hash=spec_hash,
            created_at=time.time(), tensors=tensors, state=state,
            total_bytes=sum(r.nbytes for r in receipts),
        )
        data = manifest.model_dump_json().encode()
        path = self.manifest_path(step)
        try:
            self.storage.create_exclusive(path, data)
        except AlreadyCommitted:
            # Our own earlier attempt may have landed (retried request): same step and same
            # shard set means the same checkpoint. Anything else is a second writer.
            existing = self.read_manifest(step)
            if existing.tensors != manifest.tensors:
                raise RuntimeError(
                    f"checkpoint step {step} was committed by another writer with different shards"
                ) from None
            return existing
        return manifest

    def read_manifest(self, step: int) -> Manifest:
        return Manifest.model_validate(json.loads(self.storage.read(self.manifest_path(step))))

    def all_steps(self) -> list[int]:
        """Every step directory, committed or not, oldest first."""
        steps = (parse_step_dir(name) for name in self.storage.listdir(self.storage.root))
        return sorted(s for s in steps if s is not None)

    def committed_steps(self) -> list[int]:
        """Steps with a committed manifest, oldest first."""
        return [s for s in self.all_steps() if self.storage.exists(self.manifest_path(s))]

    def latest(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def apply_retention(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` committed checkpoints; return the deleted steps.

        The newest committed checkpoint is never deleted (keep >= 1 is enforced by the spec).
        """
        committed = self.committed_steps()
        doomed = committed[: max(0, len(committed) - max(1, keep))]
        for step in doomed:
            # Manifest first: from that moment the checkpoint no longer exists for readers,
            # so a crash in the middle leaves only garbage, never a half-deleted checkpoint.
            self.storage.fs.rm(self.manifest_path(step))
            self.storage.remove_tree(self.storage.path(step_dir(step)))
        if doomed:
            log.info("retention kept %d checkpoints, deleted steps %s", keep, doomed)
        return doomed

    def collect_garbage(self, in_flight: set[int] = frozenset()) -> list[int]:
        """Remove step directories without a manifest that are older than the newest commit."""
        latest = self.latest()
        if latest is None:
            return []
        committed = set(self.committed_steps())
        orphans = [s for s in self.all_steps() if s < latest and s not in committed and s not in in_flight]
        for step in orphans:
            self.storage.remove_tree(self.storage.path(step_dir(step)))
        return orphans
