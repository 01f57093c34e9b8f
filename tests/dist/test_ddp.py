"""DDP engine on 2 and 4 gloo ranks: parity with one process, and bit-exact resume."""

from functools import cache

import pytest
import torch

from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.engine import Engine

pytestmark = pytest.mark.dist

STEPS = 10
DATA = DataConfig(seq_len=32)
# Two microbatches of one sample per rank at dp=4, four at dp=2: no_sync is exercised.
TRAIN = TrainConfig(steps=STEPS, global_batch=8, micro_batch=1, lr=3e-3, warmup_steps=2)


def make_engine(model: ModelConfig, rank: int, world_size: int) -> Engine:
    return Engine(model, DATA, TRAIN, ParallelConfig(dp=world_size), rank=rank, world_size=world_size)


def train(rank: int, world_size: int, model: ModelConfig, steps: int, snapshot_at: int | None = None):
    """Runs on every rank: `steps` steps; the state before step `snapshot_at` and at the end."""
    engine = make_engine(model, rank, world_size)
    results, snapshot = [], None
    for _ in range(steps):
        if engine.next_step == snapshot_at:
            snapshot = engine.state_tensors(), engine.state_meta()
        results.append(engine.train_step())
    return results, engine.state_tensors(), snapshot


def resume(rank: int, world_size: int, model: ModelConfig, snapshot: tuple, steps: int):
    """Runs on every rank of a brand-new process group: a fresh engine, restored, then `steps` steps."""
    engine = make_engine(model, rank, world_size)
    engine.load_state(*snapshot)
    results = [engine.train_step() for _ in range(steps)]
    return results, engine.state_tensors()


@cache
def reference():
    """The single-process run every layout must reproduce (same global batch, no DDP)."""
    results, state, _ = train(0, 1, ModelConfig(preset="tiny"), STEPS)
    return [r.loss for r in results], state


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_the_single_process_reference(world_size):
    ref_losses, ref_state = reference()
    ranks = run_ranks(train, world_size, (ModelConfig(preset="tiny"), STEPS, 5))

    rank0_results, rank0_state, _ = ranks[0]
    assert [r.loss for r in rank0_results] == pytest.approx(ref_losses, abs=1e-5, rel=0)
    assert ref_losses[-1] < ref_losses[0] - 0.5  # the comparison is over a run that learns
    for results, state, _ in ranks:
        # Every rank reports the same global loss and holds the same replica, bit for bit.
        assert [r.loss for r in results] == [r.loss for r in rank0_results]
        assert [r.tokens for r in results] == [r.tokens for r in rank0_results]
        assert all(0 < r.compute_s <= r.step_s for r in results)
        for name, value in state.items():
            assert torch.equal(value, rank0_state[name]), name
    for name, value in ref_state.items():
        if name.startswith("model/"):
            torch.testing.assert_close(rank0_state[name], value, rtol=0, atol=1e-5, msg=name)

    # The replicated state does not depend on the layout: it continues in one process.
    single = make_engine(ModelConfig(preset="tiny"), 0, 1)
    single.load_state(*ranks[0][2])
    assert [single.train_step().loss for _ in range(5)] == pytest.approx(ref_losses[5:], abs=1e-5, rel=0)


def test_resume_on_four_ranks_is_bit_exact():
    # Dropout on: the per-step reseeding is what lets a resume skip RNG state.
    model = ModelConfig(preset="tiny", dropout=0.1)
    straight = run_ranks(train, 4, (model, 6, 3))
    snapshot = straight[0][2]
    for _, _, other in straight[1:]:
        assert all(torch.equal(other[0][k], v) for k, v in snapshot[0].items())
    resumed = run_ranks(resume, 4, (model, snapshot, 3))

    straight_losses = [r.loss for r in straight[0][0][3:]]
    for (results, state), (_, straight_state, _) in zip(resumed, straight, strict=True):
        assert [r.loss for r in results] == straight_losses
        assert [r.step for r in results] == [3, 4, 5]
        assert state.keys() == straight_state.keys()
        for name, value in straight_state.items():
            assert torch.equal(state[name], value), name


def bucket_layouts(rank: int, world_size: int):
    """DDP's bucket layout (parameter names per bucket, in reduction order) after construction and after 3 steps."""
    engine = Engine(ModelConfig(preset="tiny"), DATA, TRAIN.model_copy(update={"global_batch": 4}),
                    ParallelConfig(dp=world_size, ddp_bucket_mb=0.05), rank=rank, world_size=world_size)
    names = {id(p): n for n, p in engine.model.named_parameters()}

    def layout():
        return [[names[id(p)] for p in b.parameters()] for b in engine._ddp.reducer._get_zeros_like_grad_buckets()]

    built = layout()
    for _ in range(3):
        engine.train_step()
    return built, layout(), list(names.values())


def test_bucket_layout_is_fixed_at_construction_in_reverse_registration_order():
    # A rebuild after the first step would give a restored engine other buckets than the run it resumes.
    for built, trained, registered in run_ranks(bucket_layouts, 2):
        assert len(built) > 1 and trained == built
        assert [name for bucket in built for name in bucket] == registered[::-1]
