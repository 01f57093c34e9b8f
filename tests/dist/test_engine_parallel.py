"""The engine's DP / ZeRO / TP / precision / recomputation paths on gloo ranks, against one process.

Every layout trains the same global batches; its state, assembled from all ranks' slices,
must match the single-process reference. Several layouts share one launch of ranks (each
engine builds its own DeviceMesh groups) to keep the start-up cost down.
"""

from __future__ import annotations

import gc
import logging
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from tests.dist._launch import run_ranks
from tests.dist._updates import check_updates
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.dtensor_slices import local
from trainer.engine import Engine
from trainer.loss import token_loss_sum
from trainer.model import Block, build_model, make_norm, rope_tables
from trainer.state_slices import assemble
from trainer.tensor_parallel import apply_tensor_parallel, loss_context
from trainer.topology import Topology, build_mesh

pytestmark = pytest.mark.dist

STEPS = 10
MODEL = ModelConfig(vocab_size=128, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64, max_seq_len=64,
                    rope_theta=500000.0, rope_scaling={"factor": 8.0, "original_max_position_embeddings": 16})
DATA = DataConfig(seq_len=16)
# Two microbatches per rank at dp=4, four at dp=2: gradient accumulation is exercised.
TRAIN = TrainConfig(steps=STEPS, global_batch=8, micro_batch=1, lr=3e-3, warmup_steps=2)


def par(dp=1, tp=1, zero=0, **extra) -> ParallelConfig:
    return ParallelConfig(dp=dp, tp=tp, zero=zero, **extra)


def train_layouts(rank, world_size, runs, steps=STEPS):
    """On every rank: for each (model, train, parallel), `steps` steps; losses, final slices and the
    global gradient norms (before clipping)."""
    out = []
    for model, train, parallel in runs:
        engine = Engine(model, DATA, train, parallel, rank=rank, world_size=world_size)
        results = [engine.train_step() for _ in range(steps)]
        out.append(([r.loss for r in results], engine.state_slices(), [r.grad_norm for r in results]))
        del engine
        gc.collect()
    return out


@cache
def reference(model=MODEL, train=TRAIN, steps=STEPS):
    """The single-process run every layout must reproduce: losses, state, gradient norms."""
    ((losses, slices, norms),) = train_layouts(0, 1, [(model, train, par())], steps)
    return losses, assemble(slices), norms


def check_replicas(slices) -> None:
    """Identical slices are reported by exactly `replicas` ranks, numbered 0..replicas-1."""
    holders: dict = {}
    for piece in slices:
        holders.setdefault(piece.key, []).append(piece)
    for key, pieces in holders.items():
        assert sorted(p.replica for p in pieces) == list(range(pieces[0].replicas)), key
        assert all(torch.equal(p.tensor, pieces[0].tensor) for p in pieces), key


def check_parity(ranks, index, ref, label, loss_rel=1e-5, param_atol=1e-4, norm_rel=1e-4):
    """Losses, the global gradient norm (what clipping divides by, summed over the shards of every
    parallel dim with each replicated piece counted once) and the parameters, against the reference."""
    ref_losses, ref_state, ref_norms = ref
    losses, norms = ranks[0][index][0], ranks[0][index][2]
    assert losses == pytest.approx(ref_losses, rel=loss_rel), label
    assert norms == pytest.approx(ref_norms, rel=norm_rel), f"{label}: gradient norms"
    for rank_out in ranks[1:]:
        assert rank_out[index][0] == losses, f"{label}: every rank reports the same loss"
        assert rank_out[index][2] == norms, f"{label}: every rank reports the same gradient norm"
    slices = [piece for rank_out in ranks for piece in rank_out[index][1]]
    check_replicas(slices)
    state = assemble(slices)
    assert state.keys() == ref_state.keys(), label
    for name, value in ref_state.items():
        if name.startswith("model/"):
            torch.testing.assert_close(state[name], value, rtol=0, atol=param_atol, msg=f"{label} {name}")


def run_parity(world_size, layouts, model=MODEL):
    ref = reference(model)
    assert ref[0][-1] < ref[0][0] - 0.3  # the comparison is over a run that learns
    assert max(ref[2]) > TRAIN.grad_clip  # ... and clips: the parameters depend on the norm too
    ranks = run_ranks(train_layouts, world_size, ([(model, TRAIN, p) for p in layouts],), timeout_s=600)
    for index, parallel in enumerate(layouts):
        check_parity(ranks, index, ref, str(parallel))
    return ranks


def test_parity_on_two_ranks():
    run_parity(2, [par(dp=2), par(dp=2, zero=1), par(dp=2, zero=3), par(tp=2)])


def test_parity_on_four_ranks():
    run_parity(4, [par(dp=2, tp=2, zero=2), par(dp=4, zero=3), par(dp=2, tp=2, zero=3, recompute="selective")])


def test_parity_with_recomputation_and_without_sequence_parallelism():
    run_parity(2, [par(dp=2, recompute="block"), par(tp=2, sequence_parallel=False, recompute="selective")])


# Untied head, learned positions, SwiGLU, RMSNorm, and sizes that FSDP shards unevenly: on the
# dp x tp grid tok_emb's 65-row TP shard splits 33 + 32, up_proj's 35 rows 18 + 17, and over
# dp=4 alone the vocabulary's 130 rows split 33, 33, 33, 31.
VARIANT = ModelConfig(vocab_size=130, n_layers=2, n_heads=2, d_model=36, d_ff=70, max_seq_len=64,
                      tie_embeddings=False, position="learned", activation="swiglu", norm="rmsnorm")


def test_parity_untied_learned_positions_swiglu_uneven_shards():
    ranks = run_parity(4, [par(dp=2, tp=2, zero=3), par(dp=2, tp=2, zero=1, recompute="block"),
                           par(dp=4, zero=2)], model=VARIANT)

    def rows(index, name):
        return sorted({p.lengths[0] for r in ranks for p in r[index][1] if p.name == name}, reverse=True)

    assert rows(0, "model/tok_emb.weight") == [33, 32]
    assert rows(0, "model/blocks.0.mlp.up_proj.weight") == [18, 17]
    assert rows(2, "model/tok_emb.weight") == [33, 31]


@pytest.mark.heavy
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_parity_full_matrix(world_size):
    layouts = [par(dp=dp, tp=tp, zero=zero) for dp in (1, 2, 4) for tp in (1, 2) for zero in range(4)
               if dp * tp == world_size and (dp > 1 or zero == 0)]
    run_parity(world_size, layouts)


# --- resume -----------------------------------------------------------------------------------

def train_with_snapshot(rank, world_size, parallel, steps, snapshot_at):
    """`steps` steps; this rank's slices + meta before step `snapshot_at`, and at the end."""
    engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
    losses, snapshot = [], None
    for _ in range(steps):
        if engine.next_step == snapshot_at:
            snapshot = engine.state_slices(), engine.state_meta()
        losses.append(engine.train_step().loss)
    return losses, snapshot, engine.state_slices()


def read_back(saved_slices, wanted):
    """What a checkpoint reader does: each wanted slice cut out of the stored logical tensors."""
    logical = assemble(saved_slices)
    return [w.with_tensor(logical[w.name][w.index()].clone()) for w in wanted]


def resume_from(rank, world_size, parallel, saved_slices, meta, steps):
    """A fresh engine restored from every rank's saved slices; its state, then `steps` more steps."""
    engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
    engine.load_slices(read_back(saved_slices, engine.wanted_slices()), meta)
    loaded = engine.state_slices()
    losses = [engine.train_step().loss for _ in range(steps)]
    return loaded, losses, engine.state_slices()


# The default suite's sharded resume is tests/s3/test_ckpt_round_trip.py (dp2 tp2 pp2 ZeRO-3, three backends).
@pytest.mark.heavy
def test_sharded_resume_is_bit_exact_and_loads_into_other_layouts():
    sharded = par(dp=2, tp=2, zero=3)
    straight = run_ranks(train_with_snapshot, 4, (sharded, STEPS, 5), timeout_s=600)
    saved = [piece for _, (slices, _), _ in straight for piece in slices]
    meta = straight[0][1][1]
    assert meta["next_step"] == 5
    final = assemble([piece for _, _, end in straight for piece in end])

    resumed = run_ranks(resume_from, 4, (sharded, saved, meta, STEPS - 5), timeout_s=600)
    for (_, losses, _), (straight_losses, _, _) in zip(resumed, straight, strict=True):
        assert losses == straight_losses[5:]
    again = assemble([piece for _, _, end in resumed for piece in end])
    assert again.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(again[name], value), name

    # The same checkpoint in another layout: the state it holds is the saved one, exactly.
    snapshot = assemble(saved)
    other = run_ranks(resume_from, 4, (par(dp=4, zero=1), saved, meta, 2), timeout_s=600)
    single = resume_from(0, 1, par(), saved, meta, STEPS - 5)
    for pieces in ([piece for loaded, _, _ in other for piece in loaded], single[0]):
        restored = assemble(pieces)
        assert restored.keys() == snapshot.keys()
        for name, value in snapshot.items():
            assert torch.equal(restored[name], value), name
    assert single[1] == pytest.approx(straight[0][0][5:], rel=1e-5)
    assert other[0][1] == pytest.approx(straight[0][0][5:7], rel=1e-5)


# --- mixed precision ------------------------------------------------------------------------

# Low precision rounds every matmul, so it tracks fp32 only approximately. Measured over these
# 10 steps (torch 2.13, CPU): loss within 1e-4 relative, parameters within 1e-2 (AdamW moves
# a weight by about lr = 3e-3 per step whatever its gradient's size, so a rounding that flips
# a tiny gradient's sign costs a few lr). The bounds leave a few times that margin.
LOW_PRECISION_LOSS_REL = 1e-3
LOW_PRECISION_PARAM_ATOL = 3e-2  # passes weights that never moved: tests.dist._updates checks the updates
LOW_PRECISION_NORM_REL = 1e-2


def test_bf16_and_fp16_track_fp32():
    ref_losses, ref_state, _ = ref = reference()
    ((_, before, _),) = train_layouts(0, 1, [(MODEL, TRAIN, par())], steps=0)
    initial = assemble(before)
    layouts = [par(dp=2), par(dp=2, zero=3), par(tp=2)]
    runs = [(MODEL, TRAIN.model_copy(update={"precision": p}), layout) for p in ("bf16", "fp16") for layout in layouts]
    ranks = run_ranks(train_layouts, 2, (runs,), timeout_s=600)
    for index, (_, train, layout) in enumerate(runs):
        label = f"{train.precision} {layout}"
        check_parity(ranks, index, ref, label, LOW_PRECISION_LOSS_REL, LOW_PRECISION_PARAM_ATOL, LOW_PRECISION_NORM_REL)
        assert ranks[0][index][0] != ref_losses, f"{label} ran in fp32"
        state = assemble([piece for rank_out in ranks for piece in rank_out[index][1]])
        check_updates(state, initial, ref_state, label)


def fp16_overflow(rank, world_size, parallel):
    """fp16 training where rank 1 finds an inf in a gradient of step 2; then a save and a load."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("trainer.scaler").addHandler(handler)
    train = TRAIN.model_copy(update={"precision": "fp16"})
    engine = Engine(MODEL, DATA, train, parallel, rank=rank, world_size=world_size)
    seen = {}

    def hook(point, step):
        if step != 2:
            return
        seen[point] = engine.state_slices()
        if point == "after_backward" and rank == 1:
            grad = next(p.grad for p in engine.model.parameters() if p.grad is not None)
            local(grad).view(-1)[0] = float("inf")

    engine.fault_hook = hook
    results = [engine.train_step() for _ in range(4)]
    engine.fault_hook = None
    saved, meta = engine.state_slices(), engine.state_meta()
    fresh = Engine(MODEL, DATA, train, parallel, rank=rank, world_size=world_size)
    fresh.load_slices(saved, meta)
    return results, seen, records, meta, fresh.state_meta(), fresh.train_step().loss, engine.train_step().loss


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere():
    for results, seen, records, meta, fresh_meta, fresh_loss, loss in run_ranks(
            fp16_overflow, 2, (par(dp=2, zero=2),), timeout_s=600):
        assert [r.skipped for r in results] == [False, False, True, False]
        scale = results[0].loss_scale
        assert [r.loss_scale for r in results] == [scale, scale, scale, scale / 2]
        for before, after in zip(seen["before_step"], seen["after_optimizer_step"], strict=True):
            assert before.key == after.key and torch.equal(before.tensor, after.tensor), before.name
        assert records == [f"fp16 overflow at step 2: step skipped, loss scale {scale:g} -> {scale / 2:g} "
                           "(1 skipped so far)"]
        assert meta["scaler"] == {"scale": scale / 2, "clean_steps": 1, "skipped": 1, "skipped_at_min": 0}
        assert fresh_meta["scaler"] == meta["scaler"] and fresh_loss == loss


# --- tensor parallelism itself ------------------------------------------------------------------

class Stage(torch.nn.Module):
    """A pipeline stage's shape: blocks keyed by layer index, the final norm, an untied head."""

    def __init__(self, cfg: ModelConfig, layers: list[int]):
        super().__init__()
        self.blocks = torch.nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = make_norm(cfg)
        self.lm_head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope = rope_tables(cfg)

    def forward(self, x):
        rope = tuple(t[: x.shape[1] * self.seq_split] for t in self.rope)
        for block in self.blocks.values():
            x = block(x, rope)
        return self.lm_head(self.norm(x))


def tp_checks(rank, world_size):
    """Comms of a TP forward + loss, and a TP'd pipeline-stage-shaped module against itself unsplit."""
    mesh = build_mesh(Topology(tp=world_size))
    ids = torch.randint(0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    comms, logits_local, salts = {}, {}, {}
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(MODEL, seed=0), mesh["tp"], sp)
        salts[sp] = {block.attn.head_salt for block in model.blocks}
        with CommDebugMode() as comm, loss_context(world_size):
            logits = model(ids)
            token_loss_sum(logits, ids)
        comms[sp] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        logits_local[sp] = (tuple(logits.placements), tuple(logits.to_local().shape))
    embedding_grads = {sp: embedding_grad(mesh["tp"], ids, sp) for sp in (False, True)}
    stage_errors = {}
    cfg = VARIANT.model_copy(update={"position": "rope"})
    hidden = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(1))
    for sp in (False, True):
        torch.manual_seed(0)
        whole = Stage(cfg, [2, 3])
        split = Stage(cfg, [2, 3])
        split.load_state_dict(whole.state_dict())
        whole.seq_split, split.seq_split = 1, world_size if sp else 1
        apply_tensor_parallel(split, mesh["tp"], sp)
        F.cross_entropy(whole(hidden).flatten(0, 1), ids.flatten() % cfg.vocab_size, reduction="sum").backward()
        x = hidden.chunk(world_size, dim=1)[rank] if sp else hidden
        with loss_context(world_size):
            out = split(x)
            F.cross_entropy(out.flatten(0, 1), ids.flatten() % cfg.vocab_size, reduction="sum").backward()
        grads = {n: p.grad for n, p in split.named_parameters()}
        grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
        stage_errors[sp] = max(float((grads[n] - p.grad).abs().max()) for n, p in whole.named_parameters())
    refusals = []
    for parallel in (par(tp=world_size), par(dp=world_size, zero=1)):
        engine = Engine(MODEL, DATA, TRAIN, parallel, rank=rank, world_size=world_size)
        for call in (engine.state_tensors, lambda engine=engine: engine.load_state({}, engine.state_meta())):
            with pytest.raises(ValueError) as refused:
                call()
            refusals.append(str(refused.value))
    return comms, logits_local, stage_errors, refusals, embedding_grads, (rank, salts)


def embedding_grad(tp_mesh, ids, sequence_parallel):
    """The untied vocab-parallel embedding's own gradient after one backward, against the
    unsplit model's: (placements, bytes of the local gradient's storage, max error)."""
    cfg = MODEL.model_copy(update={"tie_embeddings": False})
    whole = build_model(cfg, seed=0)
    split = apply_tensor_parallel(build_model(cfg, seed=0), tp_mesh, sequence_parallel)
    token_loss_sum(whole(ids), ids)[0].backward()
    with loss_context(tp_mesh.size()):
        token_loss_sum(split(ids), ids)[0].backward()
    grad = split.tok_emb.weight.grad
    error = float((grad.full_tensor() - whole.tok_emb.weight.grad).abs().max())
    return tuple(grad.placements), local(grad).untyped_storage().nbytes(), error


def test_tensor_parallel_never_gathers_logits_splits_a_stage_and_refuses_whole_state():
    for comms, logits_local, stage_errors, refusals, embedding_grads, (rank, salts) in run_ranks(tp_checks, 2,
                                                                                                timeout_s=600):
        # Without SP each rank's attention dropout is salted with its tp index (its heads are other
        # heads than its peer's); with SP the ranks' generators already differ: no salt.
        assert salts == {False: {rank}, True: {None}}
        # Whole-tensor state is refused where ranks hold pieces (TP shards, ZeRO-1 optimizer state).
        assert len(refusals) == 4 and all("use state_slices() / load_slices()" in r for r in refusals)
        # Without SP the forward's only collectives are all-reduces (embedding, row-parallel
        # outputs, the loss's max / sum-exp / target logit): no all-gather of anything.
        assert "all_gather_into_tensor" not in comms[False] and comms[False]["all_reduce"] > 0
        assert "reduce_scatter_tensor" in comms[True]  # SP: row-parallel outputs reduce-scattered
        for sp in (False, True):
            assert logits_local[sp] == ((Shard(2),), (2, 16, MODEL.vocab_size // 2))
            assert stage_errors[sp] < 1e-5
            # The embedding's gradient is computed on this rank's vocabulary rows only (as
            # Megatron's VocabParallelEmbedding): never a whole-vocabulary tensor per rank.
            placements, storage_bytes, error = embedding_grads[sp]
            assert placements == (Shard(0),) and storage_bytes == 4 * MODEL.vocab_size // 2 * MODEL.d_model
            assert error < 1e-5
