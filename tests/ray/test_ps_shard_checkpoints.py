"""Parameter-server checkpoints through real server actors on a local Ray: every server writes its
shard from inside its asyncio actor, a killed server's replacement is restored from the commit, and
the restored servers hold the saved state exactly (a second save of theirs stores the same tensors).

The driver plays both workers in its own process, so only the servers' checkpoint calls are under
test here; the arithmetic is covered fast in tests/unit/test_ps_checkpoint.py."""

from __future__ import annotations

import pytest

from ckpt.catalog import Catalog
from ckpt.reader import load_checkpoint
from ckpt.storage import Storage
from tests.ray.test_ps import ray_local  # noqa: F401 (the module's private local Ray, a fixture)
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig

pytestmark = [pytest.mark.ray, pytest.mark.heavy]

MODEL = ModelConfig(preset="tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2, vocab_size=512, max_seq_len=32,
                    tie_embeddings=False)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=20, global_batch=8, micro_batch=2, grad_clip=None, lr=3e-3)
PARALLEL = ParallelConfig(dp=2, mode="ps", servers=2, consistency="asp")


@pytest.mark.usefixtures("ray_local")
def test_a_killed_server_is_restored_from_its_shard_checkpoint(tmp_path):
    import ray

    from paramserver.actors import ServerActor
    from paramserver.checkpoint import PSJob, latest_committed_step, restore_servers, save_ps_checkpoint
    from paramserver.partition import param_shapes, plan_shards
    from paramserver.worker import PSWorker, sparse_names
    from trainer.model import meta_model

    shards = plan_shards(param_shapes(meta_model(MODEL).named_parameters()), PARALLEL.servers, 2000)
    sparse = sparse_names(MODEL, PARALLEL.consistency)

    def server(k: int):
        return ServerActor.options(num_cpus=1).remote(k, shards[k], MODEL, TRAIN, PARALLEL.dp, "asp", None, sparse)

    servers = [server(k) for k in range(PARALLEL.servers)]
    workers = [PSWorker(w, PARALLEL.dp, MODEL, DATA, TRAIN, shards, sparse) for w in range(PARALLEL.dp)]
    for step in range(3):
        for worker in workers:
            pulled = ray.get([s.pull.remote(worker.index, step, worker.rows_needed(step)) for s in servers])
            for answer in pulled:
                worker.load(answer)
            _, tokens = worker.compute(step)
            ray.get([s.push.remote(p) for s, p in zip(servers, worker.pushes(step, pulled, tokens), strict=True)])
    root, again = str(tmp_path / "ps"), str(tmp_path / "again")
    job = PSJob("ps-ray", MODEL, DATA, TRAIN, PARALLEL)
    assert save_ps_checkpoint(servers, root, 3, job=job).step == latest_committed_step(root) == 3
    ray.kill(servers[1])
    servers[1] = server(1)
    assert restore_servers(servers, root, 3) == [6, 6]  # asp: one version per push, 2 workers x 3 steps
    save_ps_checkpoint(servers, again, 3, job=job)
    saved, _ = load_checkpoint(Catalog(Storage(root)), 3)
    resaved, _ = load_checkpoint(Catalog(Storage(again)), 3)
    assert sorted(saved) == sorted(resaved) and any(name.endswith("/lazy_step") for name in saved)
    for name, value in saved.items():
        assert value.equal(resaved[name]), name
    for s in servers:
        ray.kill(s)
