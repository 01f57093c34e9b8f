"""The mesh's process groups take the job's collective timeout (trainer.topology.build_mesh): a
sub-group otherwise takes torch's default (30 minutes on gloo, 10 on NCCL) whatever the default
group's is, so a peer lost while the groups form, or inside a tensor-parallel or data-parallel
collective, would hold a survivor that long instead of elastic.collective_timeout_s."""

from __future__ import annotations

import pytest
import torch

from tests.dist._launch import run_ranks
from trainer.topology import Topology, build_mesh

pytestmark = pytest.mark.dist


def group_timeouts(rank, world_size, hsdp, timeout_s):
    """Each mesh group's timeout, and whether it is the default group (a dimension over the whole world)."""
    import torch.distributed as dist

    topology = Topology(dp=4, dp_replicate=2) if hsdp else Topology(dp=2, tp=2)
    mesh = build_mesh(topology, "cpu", timeout_s)
    names = ("dp_replicate", "dp_shard", "dp", "pp", "tp") if hsdp else ("dp", "pp", "tp")
    groups = {name: mesh.get_group(name) for name in names}
    return {name: (group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
                   group is dist.group.WORLD) for name, group in groups.items()}


@pytest.mark.parametrize("hsdp", [False, True])
def test_every_mesh_group_times_out_after_the_job_s_collective_timeout(hsdp):
    for timeouts in run_ranks(group_timeouts, 4, (hsdp, 7.0), timeout_s=120):
        # A dimension over the whole world is the default group itself (its timeout is the job's already,
        # set as the group formed): no second full group is built for it.
        assert {s for s, world in timeouts.values() if not world} == {7.0}, timeouts
        assert [name for name, (_, world) in timeouts.items() if world] == (["dp"] if hsdp else [])
    untold = run_ranks(group_timeouts, 4, (hsdp, None), timeout_s=120)[0]
    assert 1800.0 in {s for s, _ in untold.values()}, untold  # what a sub-group takes without it
