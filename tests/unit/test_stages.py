"""Pipeline building blocks without processes: chunking, StageModel, padding, traces, 1F1B order, 2BW weights."""

import pytest
import torch

from trainer.config import ModelConfig
from trainer.data import Batch
from trainer.loss import IGNORE_INDEX
from trainer.model import build_model, flops_per_token
from trainer.pipedream import DoubleBufferedWeights, one_f_one_b
from trainer.pipeline import ActionEvent, StepTrace, pad_batch
from trainer.stages import (
    StageModel,
    build_stage,
    chunk_ranks,
    layer_flops,
    local_chunks,
    partition,
    placement_of,
    split_layers,
)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(preset="tiny", **overrides)


def test_chunk_costs_add_up_to_the_models_flops():
    for cfg in (tiny(), ModelConfig(preset="llama3.2-1b"), ModelConfig(preset="llama3.1-8b")):
        for n_chunks in (1, 2, 4, cfg.n_layers + 1):
            chunks = split_layers(cfg, 2048, n_chunks)
            assert sum(c.flops_per_token for c in chunks) == flops_per_token(cfg, 2048)
            assert [c.index for c in chunks] == list(range(n_chunks))
            assert chunks[0].first and chunks[-1].last
            assert not any(c.first for c in chunks[1:]) and not any(c.last for c in chunks[:-1])
            # contiguous, in order, covering every layer once
            assert [i for c in chunks for i in c.layers] == list(range(cfg.n_layers))


def test_equal_blocks_and_a_cheap_head_split_by_count():
    chunks = split_layers(tiny(n_layers=8, vocab_size=64), 64, 4)
    assert [len(c.layers) for c in chunks] == [2, 2, 2, 2]


def test_an_expensive_head_takes_layers_from_the_last_chunk():
    cfg = ModelConfig(preset="llama3.2-1b")  # head = 6 * 128256 * 2048, about 3.8 blocks at seq 2048
    _, block, head = layer_flops(cfg, 2048)
    assert 3 * block < head < 4 * block
    chunks = split_layers(cfg, 2048, 4)
    sizes = [len(c.layers) for c in chunks]
    assert sizes[-1] < min(sizes[:-1])
    by_count = [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]
    worst_by_count = 4 * block + head
    assert max(c.flops_per_token for c in chunks) < worst_by_count
    assert [c.layers for c in chunks] != by_count
    # the optimum: no other contiguous cut has a cheaper bottleneck (exhaustive over 3 cuts)
    best = min(
        max(a * block, (b - a) * block, (c - b) * block, (16 - c) * block + head)
        for a in range(1, 15) for b in range(a + 1, 16) for c in range(b + 1, 17)
    )
    assert max(c.flops_per_token for c in chunks) == best


def test_the_last_chunk_may_hold_only_the_head():
    cfg = ModelConfig(preset="llama3.2-1b")
    chunks = split_layers(cfg, 2048, 8)  # 16 blocks, head ~ 3.8 blocks: the head stands alone
    assert len(chunks[-1].layers) == 0
    assert all(len(c.layers) >= 1 for c in chunks[:-1])


def test_partition_spreads_the_slack_and_refuses_impossible_cuts():
    # The bottleneck is the last chunk's extra (10); the first criterion allows many cuts,
    # the sum of squares picks the even one instead of [1, 1, 4].
    assert partition([1] * 6, 4, last_extra=10) == [range(0, 2), range(2, 4), range(4, 6), range(6, 6)]
    assert partition([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    assert partition([3], 1) == [range(0, 1)]
    with pytest.raises(ValueError, match="virtual_stages"):
        partition([1, 1], 4)
    with pytest.raises(ValueError, match="at least one chunk"):
        partition([1, 1], 0)


def test_round_robin_and_v_placements():
    assert chunk_ranks(4, 1) == [0, 1, 2, 3]
    assert chunk_ranks(2, 2, "loop") == [0, 1, 0, 1]
    assert chunk_ranks(4, 3, "loop") == [c % 4 for c in range(12)]
    for pp in (1, 2, 3, 4):
        ranks = chunk_ranks(pp, 2, "v")
        for r in range(pp):
            assert local_chunks(pp, 2, "v", r) == sorted([r, 2 * pp - 1 - r])
        assert ranks[0] == ranks[-1] == 0
    assert chunk_ranks(2, 4, "v") == [0, 1, 1, 0, 0, 1, 1, 0]
    assert placement_of("zero-bubble") == "v" and placement_of("interleaved") == "loop"
    with pytest.raises(ValueError, match="outside"):
        local_chunks(2, 2, "loop", 2)


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False, activation="swiglu", norm="rmsnorm"),
                                       dict(position="learned")])
def test_stages_hold_the_full_models_parameters_by_name(overrides):
    cfg = tiny(**overrides)
    full = dict(build_model(cfg, seed=3).named_parameters())
    seen: dict[str, torch.Tensor] = {}
    for chunk in split_layers(cfg, 64, 3):
        stage = build_stage(cfg, 3, chunk)
        for name, param in stage.named_parameters():
            assert name in full, name
            assert torch.equal(param, full[name]), name
            if name in stage.replica_names:
                continue
            assert name not in seen, f"{name} owned twice"
            seen[name] = param
    assert seen.keys() == full.keys()


def test_the_tied_head_copy_lives_on_the_last_chunk_only():
    cfg = tiny()
    first, middle, last = (build_stage(cfg, 0, c) for c in split_layers(cfg, 64, 3))
    assert last.replica_names == {"tok_emb.weight"} and not first.replica_names
    assert middle.tok_emb is None and middle.norm is None
    assert "blocks.1.attn.q_proj.weight" in dict(middle.named_parameters())
    untied_last = build_stage(tiny(tie_embeddings=False), 0, split_layers(tiny(tie_embeddings=False), 64, 3)[-1])
    assert untied_last.tok_emb is None and not untied_last.replica_names


@pytest.mark.parametrize("overrides", [dict(), dict(position="learned", tie_embeddings=False)])
@pytest.mark.parametrize("n_chunks", [1, 2, 5])
def test_chained_stages_compute_the_full_model(overrides, n_chunks):
    cfg = tiny(**overrides)
    full = build_model(cfg, seed=1)
    stages = [build_stage(cfg, 1, c) for c in split_layers(cfg, 32, n_chunks)]
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, full(ids), rtol=0, atol=0)


def test_stage_model_builds_on_meta_without_touching_the_global_rng():
    state = torch.get_rng_state()
    stage = build_stage(tiny(), 0, split_layers(tiny(), 64, 2)[1])
    assert torch.equal(state, torch.get_rng_state())
    assert isinstance(stage, StageModel) and stage.is_last and not stage.is_first
    assert set(stage.state_dict()) == {name for name, _ in stage.named_parameters()}


def test_padding_keeps_real_tokens_and_ignores_the_rest():
    batch = Batch(torch.tensor([[5, 6, 7]]), torch.tensor([[6, 7, IGNORE_INDEX]]))
    padded = pad_batch(batch, 5)
    assert padded.input_ids.tolist() == [[5, 6, 7, 0, 0]]
    assert padded.labels.tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert padded.n_tokens == batch.n_tokens
    assert pad_batch(padded, 5) is padded
    with pytest.raises(ValueError, match="seq_len"):
        pad_batch(padded, 4)


def test_trace_idle_fraction_and_activations_in_flight():
    gpipe = StepTrace([ActionEvent("F", 0, 0, 0, 1), ActionEvent("F", 0, 1, 1, 2),
                       ActionEvent("B", 0, 0, 3, 5), ActionEvent("B", 0, 1, 5, 7)], 0.0, 8.0)
    assert gpipe.busy_s == 6 and gpipe.idle_fraction() == pytest.approx(0.25)
    assert gpipe.max_in_flight() == 2
    # a split backward frees the activations at its weight part (W), not its input part (I)
    split = StepTrace([ActionEvent("F", 0, 0, 0, 1), ActionEvent("I", 0, 0, 1, 2), ActionEvent("F", 0, 1, 2, 3),
                       ActionEvent("W", 0, 0, 3, 4), ActionEvent("F", 0, 2, 4, 5)], 0.0, 5.0)
    assert split.max_in_flight() == 2 and split.idle_fraction() == 0.0


@pytest.mark.parametrize("p, m", [(1, 3), (2, 4), (4, 8), (4, 2)])
def test_one_f_one_b_order(p, m):
    for stage in range(p):
        order = one_f_one_b(stage, p, m)
        assert sorted(order) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
        live = most = 0
        for kind, k in order:
            assert kind == "F" or ("F", k) in order[: order.index((kind, k))]
            live += 1 if kind == "F" else -1
            most = max(most, live)
        assert most == min(p - stage, m)


def test_double_buffered_weights_backprop_through_the_version_of_the_forward():
    module = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 2.0]]))
    weights = DoubleBufferedWeights(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    x = torch.tensor([[1.0, 1.0]])

    def forward(batch):  # loss (w . x)^2 / 2 has gradient (w . x) x at the batch's version
        return torch.func.functional_call(module, weights.leaves(batch), (x,))

    out0 = forward(0)  # batch 0 on W(0) = [1, 2]
    out1 = forward(1)  # batch 1 forwarded on W(0) before batch 0's update
    (out0.square() / 2).sum().backward()
    weights.advance(0, optimizer, lr=None)  # W(1) = W(0) - 3 * [1, 1] = [-2, -1]
    assert module.weight.tolist() == [[-2.0, -1.0]]
    # batch 1's backward differentiates through W(0), not the module's W(1)
    (out1.square() / 2).sum().backward()
    assert weights.leaves(1)["weight"].grad.tolist() == [[3.0, 3.0]]
    weights.advance(1, optimizer, lr=0.5)  # W(2) = W(1) - 0.5 * grad(W(0)) = [-3.5, -2.5]
    assert module.weight.tolist() == [[-3.5, -2.5]]
    assert weights.leaves(2)["weight"].tolist() == [[-2.0, -1.0]]  # batch 2 runs on W(1)
    with pytest.raises(RuntimeError, match="in flight"):
        weights.leaves(4)  # W(3) does not exist before batch 2's update
