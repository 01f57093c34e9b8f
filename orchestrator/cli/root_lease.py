"""The driver's owner lease on its job's checkpoint root (ckpt.ownership), for `undying run`.

Called by orchestrator.cli.run and orchestrator.cli.ps_run after Ray is up and before anything
writes to the root; the caller releases the lease last, however the job ends. A root that an
`undying chaos` experiment made carries CHAOS_MARKER, which lets `chaos --fresh` delete it; any
other run that claims it takes the marker away first, so a job trained there later (a spec reused
after an experiment) is never deleted by a chaos run's --fresh. A root that another
job holds, a store that cannot be read and an owner folder that does not parse are each one line
on stderr, never a traceback; the caller exits 2 (nothing was started). A signal during the watch
is the caller's (orchestrator.cli.teardown.StartUpSignals): a claim already written is ended.
"""

from __future__ import annotations

import sys

from ckpt.owner_claims import UnreadableClaim
from ckpt.ownership import OwnerAlive, OwnerLease
from ckpt.storage import Storage
from orchestrator.cli.ckpt_catalog import error_reason, is_storage_error

# Written into every root a chaos experiment runs in (orchestrator.cli.chaos.command.prepare_root).
CHAOS_MARKER = "chaos-experiment.json"


def claim_root(spec, experiment: bool = False) -> OwnerLease | None:
    """The lease on `spec`'s checkpoint root, on a Storage of its own; None, with the reason printed.
    `experiment`: the run is a chaos experiment's, which keeps the root's CHAOS_MARKER."""
    storage = Storage(spec.checkpoint_root, spec.checkpoint.storage_options)
    try:
        lease = OwnerLease.claim(storage, f"undying run of job {spec.name!r}", spec.checkpoint.owner_lease_s,
                                 say=lambda line: print(f"undying: {line}", flush=True))
    except OwnerAlive as err:
        print(f"undying: the job cannot start: {err}", file=sys.stderr)
        return None
    except Exception as err:  # the store, or an owner folder a person must look at
        if not (is_storage_error(err) or isinstance(err, UnreadableClaim)):
            raise
        print(f"undying: the job cannot start: could not claim {storage.root}/owner ({error_reason(err)}); check "
              "the store, or, if a file there does not parse, move it aside after making sure no job runs",
              file=sys.stderr)
        return None
    try:
        if not experiment and storage.exists(storage.path(CHAOS_MARKER)):
            storage.remove(storage.path(CHAOS_MARKER))  # under the lease: only the root's holder changes it
            print(f"undying: {storage.root} was made by an `undying chaos` experiment; it is this job's root now, "
                  "and `undying chaos --fresh` no longer deletes it", flush=True)
    except Exception as err:
        lease.release()
        if not is_storage_error(err):
            raise
        print(f"undying: the job cannot start: could not remove {storage.root}/{CHAOS_MARKER} ({error_reason(err)}); "
              "check the store", file=sys.stderr)
        return None
    return lease
