"""Where a parameter-server job's servers restore from: its newest intact commit, or the initial values.

Called by the supervisor (paramserver.supervisor, its thread), with itself as `sup`: `resume(sup)`
once its actors are up (the step the job starts at: the newest commit's, or 0), `restore(sup)` in
a rollback, after the dead actors were replaced (every server from the newest intact commit and
reopened, or every server new at the initial values when nothing is committed; the step, and
whether a checkpoint gave it; a new server's initial values are `model.from_hf`'s weights for a
fine-tune: paramserver.shard.starting_values). A corrupt commit falls back to the one before
(checkpoint.restore_newest_intact). A server that does not finish its load within the restore
limit (`Checkpoints.restore_timeout`: `elastic.restore_timeout_s`) is hung or stuck on the store:
it is replaced by a new actor and the restore tried again, each time a repair of the job's budget
(paramserver.restart_budget), so a store that never answers ends the job naming the field.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from paramserver import checkpoint
from paramserver import recovery as book  # the goodput buckets
from paramserver.streams import dead_servers

log = logging.getLogger(__name__)


def latest_commit(sup) -> int | None:
    """The newest commit, listed under the driver's lease: a root the store lists empty is an error."""
    if sup.ckpt is None:
        return None
    return checkpoint.latest_committed_step(sup.ckpt.root, sup.ckpt.storage_options, sup.ckpt.owner,
                                            sup.ckpt.read_retry_s)


def resume(sup) -> int:
    """Start from the newest committed checkpoint, if the job has one. A root with none but quarantined
    ones (proven corrupt, kept as evidence) does not start from step 0 unless `--fresh` asked for it."""
    latest = latest_commit(sup)
    if latest is None:
        quarantined = [] if sup.ckpt is None or sup.ckpt.fresh else checkpoint.quarantined_steps(
            sup.ckpt.root, sup.ckpt.storage_options, sup.ckpt.owner, sup.ckpt.read_retry_s)
        if quarantined:
            raise checkpoint.PSCheckpointError(
                f"{sup.ckpt.root} holds no committed checkpoint, but the manifests of steps {quarantined} were "
                "quarantined as corrupt (moved aside, kept as evidence); the job does not start from step 0 on "
                "its own: `undying run --fresh` does")
        return 0
    sup.ledger.enter(book.RESTORE)
    step = restore_from(sup, latest)
    log.info("parameter-server job resumes from its checkpoint at step %d", step)
    return step


def restore(sup) -> tuple[int, bool]:
    latest = latest_commit(sup)
    if latest is None:
        log.warning("NO COMMITTED CHECKPOINT: every parameter server restarts from the initial values (step 0); "
                    "every step so far is redone")
        for k, server in enumerate(sup.servers):
            ray.kill(server, no_restart=True)
            sup.servers[k] = sup.new_server(k)
        sup.history.rewind(0)
        return 0, False
    latest = restore_from(sup, latest)
    # Answered at once by servers that have just loaded; one that does not fails the job, naming the limit.
    limit, refs = sup.ckpt.restore_timeout, [s.reopen.remote(latest) for s in sup.servers]
    try:
        ray.get(refs, timeout=limit[0] if limit else None)
    except GetTimeoutError:
        late = [k for k, ref in enumerate(refs) if not ray.wait([ref], timeout=0)[0]]
        raise checkpoint.ServersTimedOut(f"reopening at step {latest}", late, *limit) from None
    sup.history.rewind(latest)
    return latest, True


def restore_from(sup, newest: int) -> int:
    """Every server restored from commit `newest`, or the newest older one intact; that step."""
    ckpt = sup.ckpt
    while True:
        try:
            step = checkpoint.restore_newest_intact(
                sup.servers, ckpt.root, newest, storage_options=ckpt.storage_options, read_retry_s=ckpt.read_retry_s,
                owner=ckpt.owner, skipped=sup.skipped, timeout=ckpt.restore_timeout)
            break
        except (checkpoint.ServersTimedOut, RayActorError) as err:
            # Late (hung, stuck on the store), or dead while it loaded (its node, its memory): a repair.
            lost = err.servers if isinstance(err, checkpoint.ServersTimedOut) else sorted(dead_servers(sup.servers))
            if not lost:  # an actor error no server is dead of: not one to repair here
                raise
            sup.budget.repair(time.time(), f"server(s) {lost} lost while restoring: {err}")
            log.warning("server(s) %s lost while restoring (%s): replacing them, and restoring again", lost, err)
            for k in lost:
                ray.kill(sup.servers[k], no_restart=True)
                sup.servers[k] = sup.new_server(k)
            newest = latest_commit(sup)  # listed again: a commit the try quarantined is gone
            if newest is None:
                raise checkpoint.PSCheckpointError("no committed checkpoint left to restore") from err
    sup.saved = [s for s in sup.saved if s <= step]  # a commit skipped or quarantined is not the last
    sup.start_step = min(sup.start_step, step)
    return step
