"""A file:// checkpoint root every rank must see (orchestrator.cluster.shared_root): the driver's
owner claim is the proof, each rank actor's ping checks it, the worker group refuses one that fails."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckpt.owner_claims import sees_claim, visibility_proof
from ckpt.ownership import OwnerLease
from ckpt.storage import Storage
from orchestrator.cluster.shared_root import RootNotShared, root_proof
from orchestrator.cluster.worker_group import RayWorkerGroup
from orchestrator.rank.actor import RankActor


def test_a_process_sees_the_driver_s_claim_only_where_the_same_folder_is(tmp_path):
    storage = Storage(f"file://{tmp_path}/job")
    assert visibility_proof(storage) is None  # no claim yet: nothing to check
    lease = OwnerLease.claim(storage, "driver", lease_s=600.0)
    try:
        path, token = visibility_proof(storage)
        assert path.startswith(str(tmp_path / "job" / "owner")) and sees_claim((path, token))
        # Another node's own folder at the same path: an older run's claim there, or none at all.
        elsewhere = tmp_path / "other-node" / "job"
        shutil.copytree(tmp_path / "job", elsewhere)
        moved = str(elsewhere / os.path.relpath(path, tmp_path / "job"))
        assert sees_claim((moved, token))  # (the same claim: the same folder, as far as a check can tell)
        copy = Path(moved)
        copy.write_text(json.dumps(dict(json.loads(copy.read_text()), token="an older run's")))
        assert not sees_claim((moved, token))
        assert not sees_claim((str(tmp_path / "nowhere" / "claim-0000000000.json"), token))
        # A read that fails without proof (a mount failing over) does not fail the job: the commits will say.
        unreadable = tmp_path / "unreadable"
        unreadable.mkdir()
        assert sees_claim((str(unreadable), token))  # (IsADirectoryError: an OSError that proves nothing)
        spec = SimpleNamespace(checkpoint_root=f"file://{tmp_path}/job", checkpoint=SimpleNamespace(storage_options={}))
        assert root_proof(spec) == (path, token)
        store = SimpleNamespace(checkpoint_root="memory://bucket/job", checkpoint=SimpleNamespace(storage_options={}))
        assert root_proof(store) is None  # one namespace everywhere
    finally:
        lease.release()


def test_a_rank_actor_that_does_not_see_the_root_is_refused_by_its_worker_group(tmp_path):
    actor = RankActor.__new__(RankActor)
    actor.node_id, actor.gen, actor.raylet_pid = "f" * 56, -1, os.getppid()
    actor.sees_root = sees_claim((str(tmp_path / "owner" / "claim-0000000000.json"), "token"))  # as __init__ does
    ping = actor.ping()
    assert ping["sees_root"] is False and ping["node_alive"]
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group.spec = SimpleNamespace(checkpoint_root="file:///tmp/undying/ckpt/demo")
    group.node_of_actor, group.root_proof = {}, ("/tmp/undying/ckpt/demo/owner/claim-0000000003.json", "token")
    handle = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "a1"))
    group._remember_node(handle, {"node": "n" * 56, "sees_root": True})
    with pytest.raises(RootNotShared, match=r"checkpoint.url file:///tmp/undying/ckpt/demo: the rank actor on node "
                                            r"ffffffffffff does not see the driver's claim .*claim-0000000003.json "
                                            r"there.*or an object store \(s3://\)"):
        group._remember_node(handle, ping)
