import pytest
import torch
import torch.nn.functional as F

from trainer.config import DataConfig
from trainer.data import DataCursor
from trainer.loss import IGNORE_INDEX, token_loss_sum, token_weighted_mean

VOCAB = 32


def ragged_microbatches():
    """Microbatches of very different lengths (as data-parallel ranks see them) with logits."""
    cursor = DataCursor(DataConfig(seq_len=48, min_len_fraction=0.1, seed=2), VOCAB)
    batches = cursor.microbatches(step=0, global_batch=8, micro_batch=2, dp_rank=0, dp_size=1)
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(*b.labels.shape, VOCAB, generator=gen) for b in batches]
    return batches, logits


def test_token_weighted_loss_equals_the_loss_of_all_tokens_concatenated():
    batches, logits = ragged_microbatches()
    parts = [token_loss_sum(lg, b.labels) for b, lg in zip(batches, logits, strict=True)]
    weighted = token_weighted_mean(parts)

    flat_logits = torch.cat([lg[b.labels != IGNORE_INDEX] for b, lg in zip(batches, logits, strict=True)])
    flat_labels = torch.cat([b.labels[b.labels != IGNORE_INDEX] for b in batches])
    assert weighted == pytest.approx(F.cross_entropy(flat_logits, flat_labels).item(), rel=1e-6)

    mean_of_means = sum(float(s) / int(n) for s, n in parts) / len(parts)
    assert abs(mean_of_means - weighted) > 1e-3


def test_counts_and_sum_ignore_padding():
    batches, logits = ragged_microbatches()
    batch, lg = batches[0], logits[0]
    loss_sum, n_tokens = token_loss_sum(lg, batch.labels)
    assert int(n_tokens) == batch.n_tokens == int((batch.labels != IGNORE_INDEX).sum())
    assert (batch.labels == IGNORE_INDEX).any()
    scrambled = lg.clone()
    scrambled[batch.labels == IGNORE_INDEX] = 1e4  # padded positions must not matter
    assert torch.equal(token_loss_sum(scrambled, batch.labels)[0], loss_sum)


def test_loss_sum_gradient_is_per_token():
    logits = torch.zeros(1, 3, VOCAB, requires_grad=True)
    labels = torch.tensor([[1, 2, IGNORE_INDEX]])
    loss_sum, n_tokens = token_loss_sum(logits, labels)
    loss_sum.backward()
    assert int(n_tokens) == 2
    assert loss_sum.item() == pytest.approx(2 * torch.log(torch.tensor(float(VOCAB))).item())
    assert torch.equal(logits.grad[0, 2], torch.zeros(VOCAB))
    assert logits.grad[0, 0, 1].item() == pytest.approx(1 / VOCAB - 1)


def test_bf16_logits_are_summed_in_fp32():
    logits = torch.randn(2, 5, VOCAB).bfloat16()
    labels = torch.randint(0, VOCAB, (2, 5))
    loss_sum, _ = token_loss_sum(logits, labels)
    assert loss_sum.dtype == torch.float32
    assert loss_sum.item() == pytest.approx(token_loss_sum(logits.float(), labels)[0].item(), rel=1e-6)


def test_all_padding_is_an_error():
    with pytest.raises(ValueError, match="no loss tokens"):
        token_weighted_mean([(0.0, 0), (0.0, 0)])
