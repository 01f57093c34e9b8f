"""Pipeline parallelism on gloo ranks: parity with the single-process engine, the schedules' order and
activations in flight (how close the bubble comes to its formula is bench/engine/bubble.py's)."""

from functools import cache

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from bench.engine.bubble import formula, measure_schedules, median_bubble
from tests.dist._launch import run_ranks
from trainer.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from trainer.data import DataCursor, microbatches_per_rank
from trainer.data_parallel import SyncClock, wrap_ddp
from trainer.engine import Engine
from trainer.loss import all_reduce_token_loss, token_loss_sum
from trainer.model import build_model
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.pipedream import PipeDream2BW
from trainer.pipeline import PipelineRunner, as_group, sync_tied_grads
from trainer.stages import StageModel, build_stage, local_chunks, placement_of, split_layers
from trainer.topology import Topology, build_mesh

pytestmark = pytest.mark.dist

STEPS = 10
MODEL = ModelConfig(vocab_size=96, n_layers=4, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64, max_seq_len=32)
DATA = DataConfig(seq_len=16)
# 8 samples of 2: four microbatches per pipeline at dp=1, two at dp=2; ragged lengths exercise padding.
TRAIN = TrainConfig(steps=STEPS, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=2)


@cache
def reference(model: ModelConfig = MODEL, train: TrainConfig = TRAIN, data: DataConfig = DATA):
    """Losses, grad norms and final parameters of the single-process engine."""
    engine = Engine(model, data, train, ParallelConfig(), rank=0, world_size=1)
    results = [engine.train_step() for _ in range(STEPS)]
    params = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    return [r.loss for r in results], [r.grad_norm for r in results], params


def wrap_for_dp(stage: nn.Module, dp: int, mesh, wrap: str) -> nn.Module:
    """The stage under data parallelism over mesh["dp"], as the engine applies it (last)."""
    if dp == 1:
        return stage
    if wrap == "ddp":
        # the engine's DDP (fixed bucket layout, timing hook)
        return wrap_ddp(stage, mesh["dp"].get_group(), ParallelConfig().ddp_bucket_mb, SyncClock())
    reshard = wrap == "fsdp3"
    for block in stage.blocks.values():  # one FSDP2 unit per block, the rest at the root
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
    return fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)


def clip_grad_norm_pp(stage_models: list[StageModel], max_norm: float | None,
                      pp: dist.ProcessGroup | DeviceMesh) -> float:
    """Global L2 gradient norm over every chunk of a dp x pp pipeline (no tensor parallelism: the
    engine's trainer.grad_clip.clip_sharded_grads weighs tp replicas), measured before clipping;
    collective over pp.

    Each rank measures its chunks' gradients (a tied embedding's last-chunk copy is skipped:
    the full model has that parameter once), the squared norms are summed over the pp group,
    and every local gradient, copies included, is scaled to `max_norm` if the norm is above
    it, exactly as `trainer.optim.clip_grad_norm` does for the whole model. DTensor gradients
    (FSDP2, tensor parallel) are reduced over their own mesh by `get_total_norm`.
    """
    group = as_group(pp)
    owned, every = [], []
    for model in stage_models:
        for name, param in model.named_parameters():
            if param.grad is None:
                continue
            every.append(param)
            if name not in model.replica_names:
                owned.append(param.grad)
    device = next((p.device for m in stage_models for p in m.parameters()), None)  # NCCL reduces device tensors
    local = torch.nn.utils.get_total_norm(owned, norm_type=2.0) if owned else torch.zeros((), device=device)
    if isinstance(local, DTensor):
        local = local.full_tensor()
    squared = (local.double() ** 2).reshape(1)
    dist.all_reduce(squared, group=group)
    norm = squared.sqrt().to(local.dtype).reshape(())
    if max_norm is not None and every:
        torch.nn.utils.clip_grads_with_norm_(every, max_norm, norm)
    return float(norm)


def train_pipeline(rank: int, world_size: int, model: ModelConfig, schedule: str, pp: int, dp: int,
                   virtual: int, steps: int, wrap: str = "ddp", train: TrainConfig = TRAIN,
                   data: DataConfig = DATA):
    """Runs on every rank: `steps` optimizer steps of a pp x dp pipeline, as an engine would."""
    topology = Topology(dp=dp, pp=pp)
    mesh = build_mesh(topology)
    coords = topology.coords(rank)
    chunks = split_layers(model, data.seq_len, pp * virtual)
    mine = [chunks[c] for c in local_chunks(pp, virtual, placement_of(schedule), coords.pp)]
    stages = [build_stage(model, train.seed, chunk) for chunk in mine]
    dp_group = mesh["dp"].get_group()
    modules = [wrap_for_dp(stage, dp, mesh, wrap) for stage in stages]
    optimizer = build_optimizer(nn.ModuleList(stages), train)
    n_micro = microbatches_per_rank(train.global_batch, train.micro_batch, dp)
    runner = PipelineRunner(model, mine, modules, schedule=schedule, pp=mesh["pp"], n_micro=n_micro,
                            micro_batch=train.micro_batch, seq_len=data.seq_len, dp_size=dp,
                            amp_dtype=torch.bfloat16 if train.precision == "bf16" else None)
    cursor = DataCursor(data, model.vocab_size)
    losses, norms, in_flight = [], [], []
    for step in range(steps):
        batches = cursor.microbatches(step, train.global_batch, train.micro_batch, coords.dp, dp)
        local_tokens = sum(batch.n_tokens for batch in batches)
        tokens = torch.tensor([local_tokens])
        dist.all_reduce(tokens, group=dp_group)
        out = runner.step(batches, int(tokens))
        sync_tied_grads(stages, mesh["pp"], schedule)
        norms.append(clip_grad_norm_pp(stages, train.grad_clip, mesh["pp"]))
        set_lr(optimizer, lr_at(step, train))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum, _ = all_reduce_token_loss(out.loss_sum, local_tokens, group=dp_group)
        losses.append(loss_sum / int(tokens))
        in_flight.append(out.trace.max_in_flight())
    params = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param
            params.setdefault(name, []).append(value.detach().clone())
    return losses, norms, params, in_flight


def check_parity(ranks: list, model: ModelConfig = MODEL, train: TrainConfig = TRAIN, data: DataConfig = DATA,
                 rel: float = 1e-5, atol: float = 1e-4) -> None:
    ref_losses, ref_norms, ref_params = reference(model, train, data)
    assert ref_losses[-1] < ref_losses[0] - 0.3  # the comparison is over a run that learns
    owned: dict[str, torch.Tensor] = {}
    for losses, norms, params, _ in ranks:
        # every rank of every pipeline reports the global loss and norm
        assert losses == pytest.approx(ref_losses, rel=rel, abs=0)
        assert norms == pytest.approx(ref_norms, rel=10 * rel, abs=0)
        for name, copies in params.items():
            for value in copies:  # a tied embedding's two copies, or dp replicas, stay equal
                torch.testing.assert_close(value, ref_params[name], rtol=0, atol=atol, msg=name)
                owned.setdefault(name, value)
    assert owned.keys() == ref_params.keys()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_match_the_single_process_engine(schedule):
    check_parity(run_ranks(train_pipeline, 2, (MODEL, schedule, 2, 1, 1, STEPS)))


def test_interleaved_two_virtual_stages_match():
    ranks = run_ranks(train_pipeline, 2, (MODEL, "interleaved", 2, 1, 2, STEPS))
    check_parity(ranks)


def test_pipeline_with_ddp_over_the_dp_group_matches():
    ranks = run_ranks(train_pipeline, 4, (MODEL, "1f1b", 2, 2, 1, STEPS))
    check_parity(ranks)


@pytest.mark.parametrize("schedule, wrap", [("1f1b", "fsdp3"), ("zero-bubble", "fsdp2")])
def test_pipeline_with_fsdp2_over_the_dp_group_matches(schedule, wrap):
    virtual = 2 if schedule == "zero-bubble" else 1
    check_parity(run_ranks(train_pipeline, 4, (MODEL, schedule, 2, 2, virtual, STEPS, wrap)))


def test_zero_bubble_v_schedule_matches():
    check_parity(run_ranks(train_pipeline, 2, (MODEL, "zero-bubble", 2, 1, 2, STEPS)))


UNTIED = ModelConfig(vocab_size=96, n_layers=4, n_heads=4, d_model=32, d_ff=64, max_seq_len=32,
                     tie_embeddings=False, position="learned", activation="swiglu", norm="rmsnorm")


@pytest.mark.heavy
@pytest.mark.parametrize("schedule, pp, dp, virtual", [
    ("gpipe", 2, 2, 1), ("1f1b", 4, 1, 1), ("interleaved", 2, 2, 2), ("zero-bubble", 4, 1, 2),
    ("gpipe", 4, 1, 1),
])
def test_schedule_matrix_matches(schedule, pp, dp, virtual):
    model = ModelConfig(vocab_size=96, n_layers=8, n_heads=4, d_model=32, d_ff=64, max_seq_len=32)
    check_parity(run_ranks(train_pipeline, pp * dp, (model, schedule, pp, dp, virtual, STEPS)), model)


@pytest.mark.heavy
def test_bf16_autocast_tracks_the_engines_bf16():
    # fp32 sums in another order (the tied gradient, say) move a master weight by an ulp,
    # which now and then flips its bf16 cast by a bf16 ulp (0.4 %), and Adam turns a few
    # such flips into 1e-3 weight differences: bf16 runs agree closely, not to fp32 rounding.
    train = TRAIN.model_copy(update={"precision": "bf16"})
    ref_losses, ref_norms, ref_params = reference(MODEL, train)
    initial = {name: p.detach() for name, p in build_model(MODEL, train.seed).named_parameters()}
    ranks = run_ranks(train_pipeline, 2, (MODEL, "1f1b", 2, 1, 1, STEPS, "ddp", train))
    for losses, norms, params, _ in ranks:
        assert losses == pytest.approx(ref_losses, rel=5e-4, abs=0)
        assert norms == pytest.approx(ref_norms, rel=1e-2, abs=0)
        for name, (value, *_) in params.items():
            drift = (value - ref_params[name]).norm() / (ref_params[name] - initial[name]).norm()
            assert drift < 0.05, name


@pytest.mark.heavy
def test_untied_learned_positions_swiglu_matches():
    check_parity(run_ranks(train_pipeline, 2, (UNTIED, "1f1b", 2, 1, 1, STEPS)), UNTIED)


def test_gpipe_bubble_and_1f1b_activations_in_flight():
    p, m, steps = 2, 4, 4
    ranks = run_ranks(measure_schedules, p, (256, m, steps))
    for rank, measured in enumerate(ranks):
        for schedule in ("gpipe", "1f1b"):
            kinds = [{e.kind for e in events} for _, _, events in measured[schedule]]
            assert kinds == [{"F", "B", "L"} if rank == p - 1 else {"F", "B"}] * steps
        assert [in_flight for _, in_flight, _ in measured["gpipe"]] == [m] * steps  # fill-drain: all of them
        # 1F1B: stage s warms up with p - s forwards, then alternates, so at most p are alive
        assert [in_flight for _, in_flight, _ in measured["1f1b"]] == [p - rank] * steps
    # The timestamps are one clock across processes (CLOCK_MONOTONIC) and show the
    # dependencies: stage 1 starts after stage 0's first forward, and stage 0's first
    # backward waits for stage 1's.
    (first, last) = ({(e.kind, e.micro): e for e in measured["gpipe"][1][2]} for measured in ranks)
    assert last["F", 0].start >= first["F", 0].end
    assert first["B", 0].start >= last["B", 0].end
    assert first["B", 0].start >= first["F", m - 1].end  # fill-drain on stage 0
    # Loose: other processes share the two cores and stretch single actions (seen at load 30:
    # 2x the formula). How close it comes on an idle machine is `python -m bench.engine.bubble`'s.
    expected = formula(p, m)
    assert 0.5 * expected < median_bubble(ranks, "gpipe") < 2.5 * expected


PIPEDREAM_STEPS = 6
PIPEDREAM_TRAIN = TrainConfig(steps=PIPEDREAM_STEPS, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=2,
                              grad_clip=None)


def pipedream_reference(model: ModelConfig):
    """One process, PipeDream-2BW's rule: W(t+1) = W(t) - lr * grad f_t(W(t-1)), W(-1) = W(0)."""
    newest, stale = build_model(model, PIPEDREAM_TRAIN.seed), build_model(model, PIPEDREAM_TRAIN.seed)
    optimizer = build_optimizer(newest, PIPEDREAM_TRAIN)
    cursor, losses = DataCursor(DATA, model.vocab_size), []
    for step in range(PIPEDREAM_STEPS):
        batches = cursor.microbatches(step, PIPEDREAM_TRAIN.global_batch, PIPEDREAM_TRAIN.micro_batch, 0, 1)
        tokens = sum(b.n_tokens for b in batches)
        loss = 0.0
        for batch in batches:
            part, _ = token_loss_sum(stale(batch.input_ids), batch.labels)
            (part / tokens).backward()
            loss += float(part.detach())
        losses.append(loss / tokens)
        with torch.no_grad():
            for (_, p_new), (_, p_old) in zip(newest.named_parameters(), stale.named_parameters(), strict=True):
                p_new.grad, p_old.grad = p_old.grad, None
                p_old.copy_(p_new)  # W(t) becomes the next step's stale version
        set_lr(optimizer, lr_at(step, PIPEDREAM_TRAIN))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, dict(newest.named_parameters()), dict(stale.named_parameters())


def initial_weights_loss(model: ModelConfig, step: int) -> float:
    """Token-weighted loss of step `step`'s batch under the initial weights."""
    full = build_model(model, PIPEDREAM_TRAIN.seed)
    batches = DataCursor(DATA, model.vocab_size).microbatches(step, PIPEDREAM_TRAIN.global_batch,
                                                               PIPEDREAM_TRAIN.micro_batch, 0, 1)
    with torch.no_grad():
        parts = [token_loss_sum(full(b.input_ids), b.labels) for b in batches]
    return sum(float(s) for s, _ in parts) / sum(int(n) for _, n in parts)


def train_pipedream(rank: int, world_size: int, model: ModelConfig):
    chunk = split_layers(model, DATA.seq_len, world_size)[rank]
    stage = build_stage(model, PIPEDREAM_TRAIN.seed, chunk)
    optimizer = build_optimizer(stage, PIPEDREAM_TRAIN)
    n_micro = microbatches_per_rank(PIPEDREAM_TRAIN.global_batch, PIPEDREAM_TRAIN.micro_batch, 1)
    runner = PipeDream2BW(stage, chunk, optimizer, pp=dist.group.WORLD, n_micro=n_micro,
                          micro_batch=PIPEDREAM_TRAIN.micro_batch, seq_len=DATA.seq_len, d_model=model.d_model,
                          lr_at=lambda step: lr_at(step, PIPEDREAM_TRAIN))
    cursor = DataCursor(DATA, model.vocab_size)
    batches = [cursor.microbatches(s, PIPEDREAM_TRAIN.global_batch, PIPEDREAM_TRAIN.micro_batch, 0, 1)
               for s in range(PIPEDREAM_STEPS)]
    tokens = [sum(b.n_tokens for b in step) for step in batches]
    # two runs: the state carried between them (newest weights, stashed version) must suffice
    losses = runner.run(batches[:3], tokens[:3], first_step=0) + runner.run(batches[3:], tokens[3:], first_step=3)
    newest = {name: p.detach().clone() for name, p in stage.named_parameters()}
    return losses, newest, runner.stashed_weights(), runner.uses


def test_pipedream_2bw_follows_the_delayed_update_with_stashed_weights():
    model = UNTIED
    ref_losses, ref_newest, ref_stale = pipedream_reference(model)
    ranks = run_ranks(train_pipedream, 2, (model,))
    for losses, newest, stashed, _ in ranks:
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
        for name, value in newest.items():
            torch.testing.assert_close(value, ref_newest[name].detach(), rtol=0, atol=1e-4, msg=name)
            torch.testing.assert_close(stashed[name], ref_stale[name].detach(), rtol=0, atol=1e-4, msg=name)
    # Batches 0 and 1 both ran on W(0): with no delay batch 1 would have seen W(1).
    assert ranks[0][0][1] == pytest.approx(initial_weights_loss(model, 1), rel=1e-5)
    for _, _, _, uses in ranks:
        assert all(u.forward_version == u.backward_version == max(u.batch - 1, 0) for u in uses)
    # On stage 0 the weights were updated while microbatches were in flight, and their
    # backward still used the version their forward used: stashing was needed and used.
    assert any(u.newest_at_backward > u.newest_at_forward for u in ranks[0][3])


def refusal_messages(rank: int, world_size: int):
    """Runs on every rank: the ValueError of each layout the pipeline code must refuse."""
    messages = {}

    def refused(key, build):
        try:
            build()
        except ValueError as err:
            messages[key] = str(err)

    chunks = split_layers(MODEL, DATA.seq_len, 2 * world_size)
    v_chunks = [chunks[c] for c in local_chunks(world_size, 2, "v", rank)]
    v_stages = [build_stage(MODEL, 0, c) for c in v_chunks]
    common = dict(pp=dist.group.WORLD, n_micro=4, micro_batch=2, seq_len=DATA.seq_len)
    solo = [dist.new_group([r]) for r in range(world_size)]  # a dp group of one: DDP, no peers
    wrapped = [DistributedDataParallel(s, process_group=solo[rank]) for s in v_stages]
    refused("zb_ddp", lambda: PipelineRunner(MODEL, v_chunks, wrapped, schedule="zero-bubble", **common))
    solo_mesh = DeviceMesh.from_group(solo[rank], "cpu")
    for reshard in (True, False):
        sharded = [fully_shard(build_stage(MODEL, 0, c), mesh=solo_mesh, reshard_after_forward=reshard)
                   for c in v_chunks]
        refused(f"zb_fsdp_reshard_{reshard}",
                lambda sharded=sharded: PipelineRunner(MODEL, v_chunks, sharded, schedule="zero-bubble", **common))
    loop = [chunks[c] for c in local_chunks(world_size, 2, "loop", rank)]
    refused("zb_loop", lambda: PipelineRunner(MODEL, loop, [build_stage(MODEL, 0, c) for c in loop],
                                              schedule="zero-bubble", **common))
    one = split_layers(MODEL, DATA.seq_len, world_size)[rank]
    refused("interleaved_one", lambda: PipelineRunner(MODEL, [one], [build_stage(MODEL, 0, one)],
                                                      schedule="interleaved", **common))
    refused("pipedream_sched", lambda: PipelineRunner(MODEL, [one], [build_stage(MODEL, 0, one)],
                                                      schedule="pipedream", **common))
    refused("1f1b_few", lambda: PipelineRunner(MODEL, [one], [build_stage(MODEL, 0, one)], schedule="1f1b",
                                               **{**common, "n_micro": 1}))
    for key, model, n_micro in (("pd_tied", MODEL, 4), ("pd_few", UNTIED, 1)):
        chunk = split_layers(model, DATA.seq_len, world_size)[rank]
        stage = build_stage(model, 0, chunk)
        refused(key, lambda stage=stage, chunk=chunk, model=model, n_micro=n_micro: PipeDream2BW(
            stage, chunk, build_optimizer(stage, PIPEDREAM_TRAIN), pp=dist.group.WORLD, n_micro=n_micro,
            micro_batch=2, seq_len=DATA.seq_len, d_model=model.d_model))
    return messages


def test_layouts_the_pipeline_cannot_run_are_refused_by_name():
    for messages in run_ranks(refusal_messages, 2):
        assert "DDP" in messages["zb_ddp"]
        assert "reshard_after_forward=False" in messages["zb_fsdp_reshard_True"]
        assert "zb_fsdp_reshard_False" not in messages  # ZeRO-2 behaviour runs (parity test above)
        assert "local_chunks" in messages["zb_loop"]  # round-robin chunks under the V schedule
        assert "virtual_stages" in messages["interleaved_one"]
        assert "trainer.pipedream" in messages["pipedream_sched"]
        assert "train.global_batch" in messages["1f1b_few"]
        assert "model.tie_embeddings" in messages["pd_tied"]
        assert "train.global_batch" in messages["pd_few"]
