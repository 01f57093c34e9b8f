"""`undying ckpt gc URL`: delete old committed checkpoints and unfinished saves, never the newest
checkpoint that is intact.

Protocol (one process): hold the folder's owner lease (ckpt.ownership; not for --dry-run or
--force), plan (`Catalog.gc_plan`: the newest --keep committed checkpoints kept, unfinished saves
older than the newest commit deleted), then find the anchor: committed checkpoints are verified
newest first, every chunk's checksum as `ckpt verify` reads it, until one verifies. A committed
checkpoint is deleted only when it is older than the anchor: were the newest --keep all damaged
(a torn upload, a bad disk, a bucket lifecycle rule), keeping them by age alone would delete the
only one a job could resume from. Without an anchor no committed checkpoint is deleted. The
damaged ones stay (evidence, and `ckpt verify` says what is wrong); the exit status is then 1.
`--no-verify` keeps the newest --keep by age alone (the verification reads the newest checkpoint
whole: minutes for a large one).
"""

from __future__ import annotations

import argparse
import sys

from ckpt.catalog import Catalog, GcPlan
from orchestrator.cli.ckpt_catalog import committed_or_fail, error_reason, steps_text
from orchestrator.cli.ckpt_listing import verify_line, verify_one
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, UsageError

GC_LEASE_S = 60.0  # what a job that starts during a gc waits for at most, should gc die holding it


def collect_garbage(catalog: Catalog, args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep {args.keep}: must be at least 1; the newest committed checkpoint is never deleted")
    if args.read_retry_s < 0:
        raise UsageError(f"--read-retry-s {args.read_retry_s:g}: must be 0 (no retry) or more seconds")
    committed = committed_or_fail(catalog)
    lease = None if args.dry_run or args.force else _hold(catalog)
    try:
        plan = catalog.gc_plan(args.keep)  # planned while holding the folder: no job starts meanwhile
        damaged: list[int] = []
        if not args.no_verify:
            plan, damaged = _spare_newest_intact(catalog, plan, committed, args.read_retry_s)
        if not args.dry_run:
            Catalog(catalog.storage, owner=lease).apply_gc(plan)
    finally:
        if lease is not None:
            lease.release()
    _report(plan, committed, damaged, args)
    return EXIT_FAILED if damaged else EXIT_OK


def _spare_newest_intact(catalog: Catalog, plan: GcPlan, committed: list[int],
                         read_retry_s: float) -> tuple[GcPlan, list[int]]:
    """`plan` less the committed checkpoints that are not older than the newest one that verifies,
    and the steps found damaged or unverifiable on the way there (newest first)."""
    damaged = []
    for step in sorted(committed, reverse=True):
        result = verify_one(catalog, step, read_retry_s)
        print(verify_line(result), flush=True)
        if result["status"] == "ok":
            return GcPlan(expired=[s for s in plan.expired if s < step], orphans=plan.orphans), damaged
        damaged.append(step)
    return GcPlan(expired=[], orphans=plan.orphans), damaged


def _report(plan: GcPlan, committed: list[int], damaged: list[int], args: argparse.Namespace) -> None:
    verb = "would delete" if args.dry_run else "deleted"
    kept = [s for s in committed if s not in plan.expired]
    if not plan.expired and not plan.orphans:
        print(f"nothing to delete: {len(committed)} committed checkpoint(s), --keep {args.keep}")
    if plan.expired:
        print(f"{verb} committed checkpoints: steps {steps_text(plan.expired)}")
    if plan.orphans:
        print(f"{verb} unfinished saves: steps {steps_text(plan.orphans)}")
    print(f"kept: steps {steps_text(kept)}" + (" (not verified: --no-verify)" if args.no_verify else ""))
    if damaged:
        anchor = max((s for s in kept if s not in damaged), default=None)
        where = (f"step {anchor}, the newest that verifies, and every newer one are kept" if anchor is not None
                 else "no committed checkpoint verifies, so none was deleted")
        print(f"undying ckpt gc: step(s) {steps_text(sorted(damaged))} do not verify (see above); {where}; "
              "look with `undying ckpt verify` before deleting them by hand", file=sys.stderr)


def _hold(catalog: Catalog):
    """The folder's owner lease for gc (ckpt.ownership), so no job starts while it plans and deletes.
    A job that holds it is refused (one that resumed behind its newest commit writes its saves below
    it, where gc would take them for unfinished ones), after watching its heartbeat when its holder
    is not known to have stopped; --force deletes without the lease."""
    from ckpt.owner_claims import UnreadableClaim
    from ckpt.ownership import OwnerAlive, OwnerLease

    try:
        return OwnerLease.claim(catalog.storage, "undying ckpt gc", GC_LEASE_S,
                                say=lambda line: print(f"undying ckpt gc: {line}", file=sys.stderr, flush=True))
    except OwnerAlive as err:
        raise UsageError(f"{err}; its saves in flight would look unfinished to gc: run gc once it has stopped, "
                         "or pass --force") from None
    except UnreadableClaim as err:  # who holds the folder is unknown
        raise UsageError(f"{catalog.storage.root}/owner: {error_reason(err)}; a person must look (no job may run "
                         "there while one is moved aside), or pass --force") from None
