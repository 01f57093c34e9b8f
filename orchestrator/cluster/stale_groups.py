"""A former driver's placement group of the same checkpoint root, left on the Ray cluster.

A driver that holds a job's root lease (ckpt.ownership) is the job's only driver: any earlier one
lost the root, to a rerun that watched its heartbeat stop. When that earlier driver stopped
beating while it lived (a stopped process, a partitioned host) on the same cluster, its placement
group still reserves the seats the new driver needs, and the new placement would wait them out
and fail. So a job's placement group is named for its root (`group_name`: a digest of the root
URL, the same for every driver of the job, another for every other job), and the new driver,
under the lease, removes the groups of that name before it places its own (`remove_stale`):
Ray ends the actors in them, and the fenced driver, whose commits the lease refuses already,
finds its ranks gone.

Protocol: `RayWorkerGroup.place` (orchestrator.cluster.worker_group) calls `remove_stale(name)`
then creates its group under `name`, once per driver, after `undying run` claimed the root.
Groups are listed across Ray namespaces (each driver has its own), by name and state.
"""

from __future__ import annotations

import hashlib
import logging

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

log = logging.getLogger(__name__)

PREFIX = "undying-root-"


def group_name(checkpoint_root: str) -> str:
    """The placement group name of every driver of the job whose checkpoints live at `checkpoint_root`."""
    return PREFIX + hashlib.sha256(checkpoint_root.encode()).hexdigest()[:24]


def remove_stale(name: str) -> int:
    """Remove every placement group named `name` that Ray has not removed yet; returns how many. Best
    effort: a cluster that does not list or remove them (a Ray client's limits) leaves the placement to
    wait for the seats as it did before, with a warning, rather than failing the job here."""
    try:
        stale = [group_id for group_id, info in placement_group_table().items()
                 if info.get("name") == name and info.get("state") != "REMOVED"]
        for group_id in stale:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
    except Exception as err:  # noqa: BLE001 (the takeover's clean-up; the placement reports what is short)
        log.warning("could not look for a former driver's placement groups of this root (%s: %s)",
                    type(err).__name__, err)
        return 0
    return len(stale)
