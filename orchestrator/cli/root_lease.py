"""The driver's owner lease on its job's checkpoint root (ckpt.ownership), for `undying run`.

Called by orchestrator.cli.run and orchestrator.cli.ps_run after Ray is up and before anything
writes to the root; the caller releases the lease last, however the job ends. A root that an
`undying chaos` experiment made carries CHAOS_MARKER, which lets `chaos --fresh` delete it; any
other run takes the marker away (`took_over`) under the lease, after its last refusal, right
before it trains, so a job trained there later (a spec reused after an experiment) is
never deleted by a chaos run's --fresh, and a run refused at its start changes nothing. A root that another
job holds, a store that cannot be read and an owner folder that does not parse are each one line
on stderr, never a traceback; the caller exits 2 (nothing was started). A signal during the watch
is the caller's (orchestrator.cli.teardown.StartUpSignals): a claim already written is ended.
"""

from __future__ import annotations

import sys

from ckpt.catalog import Catalog
from ckpt.late_commits import record_history
from ckpt.owner_claims import UnreadableClaim
from ckpt.ownership import OwnerAlive, OwnerLease
from ckpt.storage import Storage
from ckpt.storage_errors import ReadRetry
from orchestrator.cli.ckpt_catalog import error_reason, is_storage_error

# Written into every root a chaos experiment runs in (orchestrator.cli.chaos.harness.prepare_root).
CHAOS_MARKER = "chaos-experiment.json"


def claim_root(spec) -> OwnerLease | None:
    """The lease on `spec`'s checkpoint root, on a Storage of its own; None, with the reason printed."""
    storage = Storage(spec.checkpoint_root, spec.checkpoint.storage_options)
    try:
        return OwnerLease.claim(storage, f"undying run of job {spec.name!r}", spec.checkpoint.owner_lease_s,
                                say=lambda line: print(f"undying: {line}", flush=True))
    except OwnerAlive as err:
        print(f"undying: the job cannot start: {err}", file=sys.stderr)
    except Exception as err:  # the store, or an owner folder a person must look at
        if not (is_storage_error(err) or isinstance(err, UnreadableClaim)):
            raise
        print(f"undying: the job cannot start: could not claim {storage.root}/owner ({error_reason(err)}); check "
              "the store, or, if a file there does not parse, move it aside after making sure no job runs",
              file=sys.stderr)
    return None


def took_over(spec) -> bool:
    """Take CHAOS_MARKER from `spec`'s root, if an experiment left it there: called under the lease,
    after the run's last refusal (it is sure to train), by every run but an experiment's.
    False, with the reason printed, when the store does not let it (the job must not start: a chaos
    run's --fresh could later delete what it commits)."""
    storage = Storage(spec.checkpoint_root, spec.checkpoint.storage_options)
    try:
        if storage.exists(storage.path(CHAOS_MARKER)):
            storage.remove(storage.path(CHAOS_MARKER))
            print(f"undying: {storage.root} was made by an `undying chaos` experiment; it is this job's root now, "
                  "and `undying chaos --fresh` no longer deletes it", flush=True)
        return True
    except Exception as err:
        if not is_storage_error(err):
            raise
        print(f"undying: the job cannot start: could not remove {storage.root}/{CHAOS_MARKER} ({error_reason(err)}); "
              "check the store", file=sys.stderr)
        return False


def leased_catalog(spec, lease: OwnerLease) -> Catalog | None:
    """The job's Catalog under `lease`, its history listed at once (ckpt.late_commits: a manifest create
    of the driver that held the root before, landing after this claim, is then told from the root's
    history); None, with the reason printed, when the store keeps failing that listing."""
    catalog = Catalog(Storage(spec.checkpoint_root, spec.checkpoint.storage_options), owner=lease)
    try:
        record_history(catalog, ReadRetry(spec.checkpoint.read_retry_s))
    except Exception as err:  # the store kept failing (TransientStorageError), or refused (a 403)
        if not is_storage_error(err):
            raise
        print(f"undying: the job cannot start: could not list the committed checkpoints of {catalog.storage.root} "
              f"({error_reason(err)}); check the store", file=sys.stderr)
        return None
    return catalog
