"""Controller side of a save: collect shard receipts, commit the manifest, apply retention.

Protocol: the controller feeds every `receipt` event of the current generation to
`on_receipt`; when the receipts of all `world_size` ranks for a step are in, the manifest
is committed (ckpt.catalog) and the step becomes the newest restore point. Receipts of an
older generation never arrive here (the generation's store prefix is dropped). A pending
step that a newer commit overtook can never complete usefully and is dropped. A step whose
shards do not tile every logical tensor exactly (ckpt.manifest.merge_receipts) is refused,
logged as an error and kept in `rejected`: such a state must never become a checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ckpt.catalog import Catalog
from ckpt.errors import IncompleteCheckpoint
from ckpt.manifest import ShardReceipt

log = logging.getLogger(__name__)


@dataclass
class PendingSave:
    step: int
    started_at: float  # earliest wall time a rank began this save (estimated from its receipt)
    receipts: dict[int, ShardReceipt] = field(default_factory=dict)
    engine_state: dict | None = None


@dataclass
class Commit:
    step: int
    nbytes: int
    blocking_s: float  # worst rank's blocking time: what the save cost training
    total_s: float  # first rank starting to stage -> durable manifest
    committed_at: float


class Committer:
    def __init__(self, catalog: Catalog, job: str, spec_hash: str, keep: int):
        self.catalog = catalog
        self.job = job
        self.spec_hash = spec_hash
        self.keep = keep
        self.pending: dict[int, PendingSave] = {}
        self.latest: int | None = None
        self.rejected: dict[int, str] = {}  # step -> why its shards could not be committed

    def reset(self, latest: int | None) -> None:
        """Start of a generation: nothing is pending; `latest` is the restore point."""
        self.pending.clear()
        self.latest = latest

    def on_receipt(self, event: dict, world_size: int, generation: int, layout: dict,
                   extra_state) -> Commit | None:
        receipt = ShardReceipt.model_validate(event["receipt"])
        began = time.time() - receipt.write_s - receipt.blocking_s
        save = self.pending.setdefault(receipt.step, PendingSave(receipt.step, began))
        save.started_at = min(save.started_at, began)
        save.receipts[receipt.rank] = receipt
        if "engine" in event.get("extra", {}):
            save.engine_state = event["extra"]["engine"]
        if len(save.receipts) < world_size or save.engine_state is None:
            return None
        del self.pending[receipt.step]
        if self.latest is not None and receipt.step <= self.latest:
            return None
        try:
            return self._commit(save, generation, layout, extra_state())
        except IncompleteCheckpoint as err:
            self.rejected[save.step] = str(err)
            log.error("checkpoint step %d NOT committed: the shards of the %d ranks do not form a complete "
                      "checkpoint: %s", save.step, len(save.receipts), err)
            return None

    def _commit(self, save: PendingSave, generation: int, layout: dict, extra: dict) -> Commit:
        receipts = list(save.receipts.values())
        manifest = self.catalog.commit(
            job=self.job, step=save.step, generation=generation, layout=layout,
            spec_hash=self.spec_hash, receipts=receipts,
            state={"engine": save.engine_state, **extra},
        )
        committed_at = time.time()
        blocking = max(r.blocking_s for r in receipts)
        self.latest = save.step
        for step in [s for s in self.pending if s < save.step]:
            log.info("dropping incomplete save of step %d, overtaken by step %d", step, save.step)
            del self.pending[step]
        self.catalog.apply_retention(self.keep)
        self.catalog.collect_garbage(in_flight=set(self.pending))
        return Commit(step=save.step, nbytes=manifest.total_bytes, blocking_s=blocking,
                      total_s=committed_at - save.started_at,
                      committed_at=committed_at)
