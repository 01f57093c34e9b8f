"""`undying ckpt gc URL`: delete old committed checkpoints and unfinished saves, never the newest
checkpoint that is intact.

Protocol (one process): find the anchor first, without the lease (a large checkpoint reads for
minutes, and a job starting meanwhile must not find its folder held): committed checkpoints are
verified newest first, every chunk's checksum as `ckpt verify` reads it, until one verifies (a
job whose heartbeat advances within seconds is refused before that read, not after it). Then
hold the folder's owner lease (ckpt.ownership; not for --dry-run or --force) and plan
(`Catalog.gc_plan`: the newest --keep committed checkpoints kept, unfinished saves older than the
newest commit deleted), deleting committed ones only below the anchor, still committed. A committed
checkpoint is deleted only when it is older than the anchor: were the newest --keep all damaged
(a torn upload, a bad disk, a bucket lifecycle rule), keeping them by age alone would delete the
only one a job could resume from. Without an anchor no committed checkpoint is deleted. The
damaged ones stay (evidence, and `ckpt verify` says what is wrong); the exit status is then 1.
`--no-verify` keeps the newest --keep by age alone (the verification reads the newest checkpoint
whole: minutes for a large one).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from ckpt.catalog import Catalog, GcPlan
from ckpt.config import DEFAULT_READ_RETRY_S
from ckpt.owner_claims import UnreadableClaim
from ckpt.ownership import OwnerAlive, OwnerLease, refuse_a_beating_owner
from orchestrator.cli.ckpt_catalog import check_read_retry_s, committed_or_fail, error_reason, steps_text
from orchestrator.cli.ckpt_listing import verify_line, verify_one
from orchestrator.cli.exits import EXIT_FAILED, EXIT_OK, UsageError

GC_LEASE_S = 60.0  # what a job that starts during a gc waits for at most, should gc die holding it


def collect_garbage(catalog: Catalog, args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep {args.keep}: must be at least 1; the newest committed checkpoint is never deleted")
    check_read_retry_s(args.read_retry_s)
    if args.no_verify and args.read_retry_s != DEFAULT_READ_RETRY_S:  # it would be ignored
        raise UsageError(f"--read-retry-s {args.read_retry_s:g}: --no-verify reads no checkpoint; leave one out")
    committed = committed_or_fail(catalog)
    holds = not (args.dry_run or args.force)
    # Verified before the lease is taken: reading a large checkpoint takes minutes, and a job that
    # starts meanwhile must not find the folder held. Committed bytes do not change under it. A job
    # that runs there (its heartbeat advances within seconds) is refused before that read, not after.
    if holds and not args.no_verify:
        with _owner_errors(catalog):
            refuse_a_beating_owner(catalog.storage)
    anchor, unverified = (None, []) if args.no_verify else _newest_intact(catalog, committed, args.read_retry_s)
    lease = _hold(catalog) if holds else None
    try:
        plan = catalog.gc_plan(args.keep)  # planned while holding the folder: no job starts meanwhile
        if not args.no_verify:  # only below the anchor, which must still be committed
            still = anchor is not None and anchor in catalog.committed_steps()
            plan = GcPlan(expired=[s for s in plan.expired if still and s < anchor], orphans=plan.orphans)
        if not args.dry_run:
            Catalog(catalog.storage, owner=lease).apply_gc(plan)
    finally:
        if lease is not None:
            lease.release()
    _report(plan, committed, unverified, args)
    return EXIT_FAILED if unverified else EXIT_OK


def _newest_intact(catalog: Catalog, committed: list[int], read_retry_s: float) -> tuple[int | None, list[int]]:
    """The newest committed step that verifies whole (None: none does), and the newer ones that did
    not (damaged, or a store that kept failing), verified newest first."""
    unverified = []
    for step in sorted(committed, reverse=True):
        result = verify_one(catalog, step, read_retry_s)
        print(verify_line(result), flush=True)
        if result["status"] == "ok":
            return step, unverified
        if result["status"] != "deleted":  # a running job's retention took it meanwhile: no damage
            unverified.append(step)
    return None, unverified


def _report(plan: GcPlan, committed: list[int], unverified: list[int], args: argparse.Namespace) -> None:
    verb = "would delete" if args.dry_run else "deleted"
    kept = [s for s in committed if s not in plan.expired]
    if not plan.expired and not plan.orphans:
        print(f"nothing to delete: {len(committed)} committed checkpoint(s), --keep {args.keep}")
    if plan.expired:
        print(f"{verb} committed checkpoints: steps {steps_text(plan.expired)}")
    if plan.orphans:
        print(f"{verb} unfinished saves: steps {steps_text(plan.orphans)}")
    print(f"kept: steps {steps_text(kept)}" + (" (not verified: --no-verify)" if args.no_verify else ""))
    if unverified:
        anchor = max((s for s in kept if s not in unverified), default=None)
        where = (f"step {anchor}, the newest that verifies, and every newer one are kept" if anchor is not None
                 else "no committed checkpoint verifies, so none was deleted")
        print(f"undying ckpt gc: step(s) {steps_text(sorted(unverified))} did not verify (damaged, or the store "
              f"kept failing: see above); {where}; look with `undying ckpt verify` before deleting them by hand",
              file=sys.stderr)


def _hold(catalog: Catalog):
    """The folder's owner lease for gc (ckpt.ownership), so no job starts while it plans and deletes.
    A job that holds it is refused (one that resumed behind its newest commit writes its saves below
    it, where gc would take them for unfinished ones), after watching its heartbeat when its holder
    is not known to have stopped; --force deletes without the lease."""
    with _owner_errors(catalog):
        return OwnerLease.claim(catalog.storage, "undying ckpt gc", GC_LEASE_S,
                                say=lambda line: print(f"undying ckpt gc: {line}", file=sys.stderr, flush=True))


@contextlib.contextmanager
def _owner_errors(catalog: Catalog):
    """A live holder, or a claim nobody can read, as gc's one-line refusal (exit 2) naming the way on."""
    try:
        yield
    except OwnerAlive as err:
        raise UsageError(f"{err}; its saves in flight would look unfinished to gc: run gc once it has stopped, "
                         "or pass --force") from None
    except UnreadableClaim as err:  # who holds the folder is unknown
        raise UsageError(f"{catalog.storage.root}/owner: {error_reason(err)}; a person must look (no job may run "
                         "there while one is moved aside), or pass --force") from None
