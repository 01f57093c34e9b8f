"""Parameter-server arithmetic in one process (paramserver.lockstep): bsp equals the engine, the
sparse path moves only touched rows with lazy Adam, versions are recorded per update."""

from __future__ import annotations

import pytest
import torch

from paramserver.lockstep import build_in_process, run_lockstep
from paramserver.shard import initial_values
from paramserver.sparse import RowState, lazy_update_
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine
from trainer.model import build_model
from trainer.state_slices import assemble

MODEL = ModelConfig(preset="tiny", n_layers=2, d_model=32, d_ff=64, n_heads=2, vocab_size=64, max_seq_len=32)
DATA = DataConfig(seq_len=16)
TRAIN = TrainConfig(steps=20, global_batch=8, micro_batch=2, grad_clip=None, lr=3e-3)
SMALL_PIECES = 2000  # bytes: cuts the embedding and the MLP matrices into row bands


def _ps(consistency: str, dp: int = 2, servers: int = 2) -> ParallelConfig:
    return ParallelConfig(dp=dp, mode="ps", servers=servers, consistency=consistency,
                          staleness=1 if consistency == "ssp" else None)


@pytest.fixture(scope="module")
def engine_run():
    torch.set_num_threads(1)
    engine = Engine(MODEL, DATA, TRAIN, ParallelConfig(), rank=0, world_size=1)
    losses = [engine.train_step().loss for _ in range(TRAIN.steps)]
    return losses, assemble(engine.state_slices())


def test_bsp_equals_data_parallel_training_and_its_shards_assemble_the_model(engine_run):
    losses, state_of_engine = engine_run
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("bsp", dp=4, servers=3), SMALL_PIECES)
    ps_losses, records = run_lockstep(setup, TRAIN.steps)
    assert max(abs(a - b) for a, b in zip(ps_losses, losses, strict=True)) < 1e-5
    assert {r.staleness for r in records} == {0} and len(records) == 3 * 4 * TRAIN.steps
    assert all(server.version == TRAIN.steps for server in setup.servers)
    # The servers' slices are a checkpoint of the collective job's own logical tensors: model,
    # AdamW moments and step, the same names, shapes and (to rounding) values.
    state = assemble([piece for server in setup.servers for piece in server.state_slices()])
    assert sorted(state) == sorted(state_of_engine)
    for name, value in state_of_engine.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5)


def test_server_slices_start_from_the_models_initial_values():
    model = build_model(MODEL, TRAIN.seed)
    setup = build_in_process(MODEL, DATA, TRAIN, _ps("asp"), SMALL_PIECES)
    for server in setup.servers:
        for piece in server.slices:
            value = dict(model.named_parameters())[piece.name.removeprefix("model/")][piece.index()]
            assert torch.equal(initial_values(piece, MODEL, TRAIN.seed), value.detach())


def test_asp_pushes_only_touched_embedding_rows_and_records_staleness():
    untied = MODEL.model_copy(update={"tie_embeddings": False})
    dense = build_in_process(untied, DATA, TRAIN, _ps("bsp"), SMALL_PIECES)
    sparse = build_in_process(untied, DATA, TRAIN, _ps("asp"), SMALL_PIECES)
    before = assemble([p for s in sparse.servers for p in s.state_slices()])["model/tok_emb.weight"]
    losses, records = run_lockstep(sparse, 1)
    after = assemble([p for s in sparse.servers for p in s.state_slices()])["model/tok_emb.weight"]
    touched = torch.unique(torch.cat([w.rows_needed(0) for w in sparse.workers]))
    changed = (after != before).any(dim=1).nonzero().flatten()
    assert torch.equal(changed, touched) and len(touched) < untied.vocab_size
    run_lockstep(dense, 1)
    assert sum(s.bytes_in for s in sparse.servers) < sum(s.bytes_in for s in dense.servers)
    # Round-robin in one process: worker 1 reads after worker 0's update was applied (asp applies
    # each push at once), so every update is fresh and the versions count the pushes.
    assert [(r.worker, r.pulled_version, r.applied_version) for r in records if r.server == 0] == [(0, 0, 0),
                                                                                                   (1, 1, 1)]


def test_asp_converges_on_the_tiny_model():
    untied = MODEL.model_copy(update={"tie_embeddings": False})
    losses, _ = run_lockstep(build_in_process(untied, DATA, TRAIN, _ps("asp"), SMALL_PIECES), TRAIN.steps)
    assert losses[-1] < 3.5 < losses[0]


def test_lazy_sgd_decays_the_touched_rows_as_torch_sgd_does():
    # Every row touched every step: lazy SGD is dense SGD, weight decay (its L2 term) included.
    cfg = TrainConfig(steps=3, global_batch=1, optimizer="sgd", weight_decay=0.1, betas=(0.8, 0.9))
    torch.manual_seed(0)
    start = torch.randn(4, 3)
    mine, state, ref = start.clone(), RowState(), torch.nn.Parameter(start.clone())
    reference = torch.optim.SGD([ref], lr=0.1, momentum=0.8, weight_decay=0.1)
    for _ in range(3):
        grad = torch.randn(4, 3)
        lazy_update_(mine, torch.arange(4), grad, state, cfg, lr=0.1, weight_decay=0.1)
        ref.grad = grad.clone()
        reference.step()
    torch.testing.assert_close(mine, ref.detach())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_lazy_rows_follow_torch_sparse_semantics(optimizer):
    cfg = TrainConfig(steps=3, global_batch=1, optimizer=optimizer, weight_decay=0.0, betas=(0.8, 0.9))
    torch.manual_seed(0)
    start = torch.randn(6, 3)
    mine, state = start.clone(), RowState()
    ref = torch.nn.Parameter(start.clone())
    if optimizer == "adamw":
        reference = torch.optim.SparseAdam([ref], lr=0.1, betas=cfg.betas)
    else:
        reference = torch.optim.SGD([ref], lr=0.1, momentum=0.8)
    for rows in ([0, 2], [2, 5], [0, 2]):
        rows = torch.tensor(rows)
        grad = torch.randn(len(rows), 3)
        lazy_update_(mine, rows, grad, state, cfg, lr=0.1, weight_decay=0.0)
        dense = torch.zeros(6, 3).index_add_(0, rows, grad)
        ref.grad = dense.to_sparse() if optimizer == "adamw" else dense
        reference.step()
    if optimizer == "adamw":
        torch.testing.assert_close(mine, ref.detach())
        assert torch.equal(mine[[1, 3, 4]], start[[1, 3, 4]])
    else:
        # Dense SGD decays and applies every row's momentum each step; lazy SGD only the touched
        # rows': row 2 (touched every step) agrees, row 0 (skipped at the second step) does not.
        torch.testing.assert_close(mine[2], ref.detach()[2])
        assert not torch.allclose(mine[0], ref.detach()[0])
