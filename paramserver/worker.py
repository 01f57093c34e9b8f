"""One worker's computation: the engine's model, data cursor and loss, in one process.

Protocol (a worker actor, paramserver.actors, or the in-process driver, paramserver.lockstep,
per step s in order):
  1. `rows_needed(s)`: the embedding rows step s reads (None: no sparse slices), sent with
  2. the pulls, one per server; `load(pulled)` for each answer;
  3. `compute(s)`: forward and backward over this worker's share of the global batch (the
     same contiguous block of sample indices a collective dp rank of the same index reads,
     trainer.batch.owned_indices), returns (summed token loss, tokens);
  4. `pushes(s, pulled, tokens)`: one `Push` per server, to be sent in server order.
The model starts from the same initial values as every layout (trainer.init_values), and is
overwritten by the first pull anyway.
"""

from __future__ import annotations

import torch

from ckpt.storage_errors import data_read_retry
from paramserver.messages import Pulled, Push
from paramserver.partition import param_name
from trainer.batch import Batch
from trainer.config import DataConfig, ModelConfig, TrainConfig
from trainer.data import make_cursor
from trainer.loss import token_loss_sum
from trainer.model import build_model
from trainer.seeding import derive_seed
from trainer.state_slices import TensorSlice

# The one tensor the sparse path serves: its rows are read only by the tokens of the batch
# (with untied embeddings: a tied one is also the output projection, whose gradient is dense).
SPARSE_PARAM = "tok_emb.weight"


def sparse_names(model: ModelConfig, consistency: str) -> frozenset[str]:
    """The parameters updated sparsely: the untied embedding under ssp and asp; none under bsp,
    whose contract is equality with collective dp (dense Adam; docs/design.md)."""
    return frozenset() if consistency == "bsp" or model.tie_embeddings else frozenset({SPARSE_PARAM})


class PSWorker:
    def __init__(self, index: int, workers: int, model: ModelConfig, data: DataConfig, train: TrainConfig,
                 shards: list[list[TensorSlice]], sparse: frozenset[str] = frozenset()):
        if train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.index, self.workers, self.train, self.shards, self.sparse = index, workers, train, shards, sparse
        self.model = build_model(model, train.seed)
        self.params = dict(self.model.named_parameters())
        self.cursor = make_cursor(data, model.vocab_size, data_read_retry(data))
        self._batches: tuple[int, list[Batch]] | None = None

    def batches(self, step: int) -> list[Batch]:
        if self._batches is None or self._batches[0] != step:
            tc = self.train
            self._batches = (step, self.cursor.microbatches(step, tc.global_batch, tc.micro_batch, self.index,
                                                            self.workers))
        return self._batches[1]

    def rows_needed(self, step: int) -> torch.Tensor | None:
        if not self.sparse:
            return None
        return torch.unique(torch.cat([b.input_ids.flatten() for b in self.batches(step)]))

    @torch.no_grad()
    def load(self, pulled: Pulled) -> None:
        shard = self.shards[pulled.server]
        for i, values in pulled.dense.items():
            self.params[param_name(shard[i])][shard[i].index()].copy_(values)
        for i, (rows, values) in pulled.sparse.items():
            self.params[param_name(shard[i])][rows] = values

    def compute(self, step: int) -> tuple[float, int]:
        # The engine's dropout seed for dp rank `index` (trainer.engine: pp = 1, no sequence parallelism).
        torch.manual_seed(derive_seed(self.train.seed, "dropout", step, self.index))
        for param in self.params.values():
            param.grad = None
        loss_sum, tokens = 0.0, 0
        for batch in self.batches(step):
            part, n = token_loss_sum(self.model(batch.input_ids), batch.labels)
            part.backward()
            loss_sum += float(part.detach())
            tokens += int(n)
        return loss_sum, tokens

    @torch.no_grad()
    def pushes(self, step: int, pulled: list[Pulled], tokens: int) -> list[Push]:
        rows = self.rows_needed(step)
        out = []
        for answer in pulled:
            push = Push(self.index, step, answer.version, answer.slowest, tokens)
            for i, piece in enumerate(self.shards[answer.server]):
                name = param_name(piece)
                grad = self.params[name].grad
                grad = torch.zeros_like(self.params[name]) if grad is None else grad
                if name in self.sparse:
                    start = piece.offsets[0]
                    mine = rows[(rows >= start) & (rows < start + piece.lengths[0])]
                    push.sparse[i] = (mine, grad[mine].clone())
                else:
                    push.dense[i] = grad[piece.index()].clone()
            out.append(push)
        return out
