"""Validation loss on a held-out prepared dataset, with semantics anyone can reproduce.

The number: take the first K non-overlapping windows of T + 1 tokens of the dataset, read in
order from its start (across shards, in shard order): window k is tokens [k(T+1), (k+1)(T+1)).
Its inputs are tokens [0, T) of the window and its labels tokens [1, T+1). The loss is the
summed token cross-entropy over all K windows divided by the number of tokens, K * T (fp32
logits, each microbatch summed in fp32, the microbatches' and ranks' sums added in fp64, so a
different dp or micro_batch moves the number only in its last fp32 bits). Defaults: T = the
model's training sequence length, K = 64. A dataset holding fewer than K windows is refused
rather than silently evaluated on fewer.

Protocol:
  * one process (`undying eval`): `eval_windows(dataset, T, K)` then `loss_of_model(model, windows)`;
  * in a job: every rank builds the same windows once; `Engine.evaluate` (trainer.engine) calls
    `shard_windows` for its dp rank's share and `padded_microbatches` to give every rank of the
    dp group the same number of microbatches (FSDP and the pipeline schedule run collectives per
    forward), then adds the dp ranks' sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.batch import Batch, collate
from trainer.loss import IGNORE_INDEX, token_loss_sum

DEFAULT_WINDOWS = 64


@dataclass(frozen=True)
class EvalResult:
    loss: float  # summed token cross-entropy / tokens
    tokens: int
    windows: int
    seq_len: int


def eval_windows(dataset, seq_len: int, windows: int = DEFAULT_WINDOWS) -> list[torch.Tensor]:
    """The first `windows` non-overlapping windows of seq_len + 1 tokens of `dataset` (a
    trainer.tokens.reader.TokenDataset), as int64 tensors; ValueError when it holds fewer."""
    span = seq_len + 1
    available = len(dataset) // span
    if windows <= 0 or seq_len <= 0:
        raise ValueError(f"eval needs windows > 0 and seq_len > 0, got windows={windows}, seq_len={seq_len}")
    if available < windows:
        raise ValueError(f"{dataset.url} holds {available} windows of {span} tokens, fewer than the {windows} "
                         "asked: evaluate fewer windows or a shorter seq_len, or prepare more data")
    tokens = torch.from_numpy(dataset.read(0, windows * span)).long()
    return list(tokens.view(windows, span))


def shard_windows(windows: Sequence[torch.Tensor], dp_rank: int, dp_size: int) -> list[torch.Tensor]:
    """dp rank `dp_rank`'s contiguous share of `windows` (sizes differ by at most one)."""
    per, extra = divmod(len(windows), dp_size)
    start = dp_rank * per + min(dp_rank, extra)
    return list(windows[start:start + per + (1 if dp_rank < extra else 0)])


def padding_batch(micro_batch: int, seq_len: int) -> Batch:
    """A microbatch that carries no loss: what a rank with fewer windows runs so collectives match."""
    return Batch(torch.zeros(micro_batch, seq_len, dtype=torch.long),
                 torch.full((micro_batch, seq_len), IGNORE_INDEX, dtype=torch.long))


def padded_microbatches(windows: Sequence[torch.Tensor], micro_batch: int, count: int, seq_len: int) -> list[Batch]:
    """`windows` as `count` microbatches of `micro_batch` rows, the rest padding with no loss."""
    batches = [collate(list(windows[i:i + micro_batch])) for i in range(0, len(windows), micro_batch)]
    batches = [_fill_rows(b, micro_batch, seq_len) for b in batches]
    if len(batches) > count:
        raise ValueError(f"{len(windows)} windows need {len(batches)} microbatches, more than {count}")
    return batches + [padding_batch(micro_batch, seq_len) for _ in range(count - len(batches))]


def _fill_rows(batch: Batch, rows: int, seq_len: int) -> Batch:
    have = batch.input_ids.shape[0]
    if have == rows and batch.input_ids.shape[1] == seq_len:
        return batch
    pad = padding_batch(rows, seq_len)
    pad.input_ids[:have, :batch.input_ids.shape[1]] = batch.input_ids
    pad.labels[:have, :batch.labels.shape[1]] = batch.labels
    return pad


@torch.no_grad()
def loss_of_model(model: torch.nn.Module, windows: Sequence[torch.Tensor], batch_size: int = 8) -> EvalResult:
    """The validation loss of a whole (single-process) model on `windows` (module docstring)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    try:
        for i in range(0, len(windows), batch_size):
            batch = collate([w.cpu() for w in windows[i:i + batch_size]])
            part, n = token_loss_sum(model(batch.input_ids.to(device)), batch.labels.to(device))
            total += part.double().cpu()
            tokens += int(n)
    finally:
        model.train(was_training)
    return EvalResult(loss=float(total) / tokens, tokens=tokens, windows=len(windows),
                      seq_len=int(windows[0].numel()) - 1)
