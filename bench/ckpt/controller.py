"""The controller's half of our saves in bench.ckpt: collect the ranks' receipts, commit the manifest.

Protocol (side channel, no collective on the training group, docs/design.md invariant 5): each
rank's writer thread sets `receipt/<step>/<rank>` in a TCPStore that this process hosts,
with {"backend", "receipt", "extra"} as orchestrator/rank/loop.py sends them; a failed write
sets `error/<step>/<rank>`. For every save of the plan, in order, this loop waits for all
ranks' receipts, feeds them to ckpt.commit.Committer exactly as the controller does
(merge, coverage check, exclusive manifest create), and publishes `commit/<step>` =
{"ok", "committed_at" (time.time() of the durable manifest), "nbytes"} or {"ok": false,
"why"}. A rank process that exits early ends the loop with an error instead of a hang.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

from ckpt.catalog import Catalog
from ckpt.commit import Committer
from ckpt.manifest import ShardReceipt
from ckpt.storage import Storage

POLL = timedelta(seconds=1)


def _wait(store, keys: list[str], errors: list[str], procs) -> str | None:
    """Block until all `keys` are set; return an error message instead if a rank failed or exited."""
    while True:
        try:
            store.wait(keys, POLL)  # returns as soon as the keys are there: no polling delay
            return None
        except Exception:  # the store's timeout: check that the ranks are still alive
            pass
        failed = [key for key in errors if store.check([key])]
        if failed:
            return "; ".join(store.get(key).decode() for key in failed)
        dead = [rank for rank, proc in enumerate(procs) if proc.poll() is not None]
        if dead:
            return f"rank(s) {dead} exited"


def commit_loop(store, saves: list[tuple[int, str]], backends: dict, world: int, procs) -> list[dict]:
    """Commit each (step, backend) of `saves` once every rank's receipt is in; one record per commit."""
    committers = {name: Committer(Catalog(Storage(b["ours"], b["options"])), job="bench-ckpt",
                                  spec_hash="bench", keep=10**6)
                  for name, b in backends.items()}
    records = []
    for step, backend in saves:
        keys = [f"receipt/{step}/{rank}" for rank in range(world)]
        failure = _wait(store, keys, [f"error/{step}/{rank}" for rank in range(world)], procs)
        if failure is not None:
            store.set(f"commit/{step}", json.dumps({"ok": False, "why": failure}))
            raise RuntimeError(f"save of step {step} on {backend} failed: {failure}")
        received = time.time()
        commit = None
        for key in keys:
            event = json.loads(store.get(key))
            receipt = ShardReceipt.model_validate(event["receipt"])
            commit = committers[backend].on_receipt(receipt, event.get("extra", {}), world, 0, {"dp": world}, dict)
        if commit is None:
            why = committers[backend].rejected.get(step, "no commit")
            store.set(f"commit/{step}", json.dumps({"ok": False, "why": why}))
            raise RuntimeError(f"step {step} on {backend} was not committed: {why}")
        store.set(f"commit/{step}", json.dumps({"ok": True, "committed_at": commit.committed_at,
                                                "nbytes": commit.nbytes}))
        records.append({"step": step, "backend": backend, "nbytes": commit.nbytes, "receipts_in": received,
                        "committed_at": commit.committed_at, "commit_s": commit.committed_at - received})
    return records
