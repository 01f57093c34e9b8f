"""Asynchronous pipeline parallelism: PipeDream-2BW (Narayanan et al. 2021, arXiv:2006.09503).

The synchronous schedules (trainer.pipeline) flush the pipeline at every optimizer step:
the last microbatches of step t drain before step t+1's first ones enter, which is the
bubble. PipeDream never flushes: stage s runs one-forward-one-backward over an endless
stream of microbatches and updates its own weights as soon as it has the gradient of a
batch (m microbatches), without waiting for the other stages. Two consequences, handled by
double-buffered weights (2BW):

  * A microbatch's backward must use the weights its forward used, although the stage may
    have updated them in between. Each version is a separate set of tensors; a microbatch
    records the version at its forward and its backward differentiates through the same
    tensors (weight stashing). Autograd's saved tensors are exactly those of the forward.
  * Semantics (PipeDream-2BW's update rule, section 3.1):

        W(t+1) = W(t) - lr * grad f_t(W(t-1)),         W(-1) = W(0)

    Every microbatch of batch t, on every stage, runs forward and backward on version
    W(t-1): gradients are one version stale, and the update that consumes them is applied
    to the newest weights W(t). With m >= p microbatches per batch, when batch t+2's first
    forward reaches a stage, batch t's last backward has left it (1F1B keeps at most p - s
    microbatches in flight on stage s), so two versions per stage are all that is ever live:
    W(t-1) (batch t in flight) and W(t) (batch t+1). The update after batch t writes W(t+1)
    into the buffer batch t has just released.

Protocol, on every rank of the pp group (one chunk per rank, round-robin chunks 0..p-1):
  1. `PipeDream2BW(module, chunk, optimizer, pp=..., ...)`: the optimizer is built over
     `module`'s parameters, which afterwards always alias the newest version.
  2. `run(batches, tokens, first_step)`: collective. Streams len(batches) batches through
     the pipeline without flushes between them (one drain at the end), applies one update
     per batch on each stage, and returns every batch's token-weighted loss on every rank.
Between runs the state is the newest weights (the module), the optimizer, and the stashed
previous version `stashed_weights()`, which the next batch's gradient needs: a checkpoint
must hold both. No gradient clipping: a global norm would need all stages at one point in
time, which is what this schedule avoids. Data parallelism is not composed here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from trainer.data import Batch
from trainer.loss import token_loss_sum
from trainer.pipeline import as_group, pad_batch
from trainer.stages import Chunk


def one_f_one_b(stage: int, n_stages: int, n_micro: int) -> list[tuple[str, int]]:
    """The 1F1B action order of `stage` over `n_micro` microbatches: [("F", k) | ("B", k), ...].

    p - s - 1 warm-up forwards, then forward/backward pairs, then the remaining backwards,
    so at most p - s microbatches are in flight on stage s (Narayanan et al. 2021).
    """
    warmup = min(n_stages - stage - 1, n_micro)
    order, forwards, backwards = [], 0, 0
    for _ in range(warmup):
        order.append(("F", forwards))
        forwards += 1
    while forwards < n_micro:
        order.append(("F", forwards))
        forwards += 1
        order.append(("B", backwards))
        backwards += 1
    while backwards < n_micro:
        order.append(("B", backwards))
        backwards += 1
    return order


@dataclass(frozen=True)
class VersionUse:
    """The weight version microbatch `micro` ran forward and backward on, and the newest version
    of the stage at each moment (different when the stage updated in between)."""

    micro: int
    batch: int
    forward_version: int
    backward_version: int
    newest_at_forward: int
    newest_at_backward: int


class DoubleBufferedWeights:
    """Two versions of a module's parameters; the module's parameters alias the newest.

    Buffer (t - 1) % 2 holds W(t-1), the version batch t runs on. `leaves(batch)` gives the
    tensors to differentiate through; `advance(batch, optimizer, lr)` turns batch t's
    accumulated gradient into W(t+1) in the buffer batch t released.
    """

    def __init__(self, module: nn.Module):
        self.params = dict(module.named_parameters())
        initial = {name: p.detach().clone() for name, p in self.params.items()}
        self.buffers = [{name: t.clone().requires_grad_(p.requires_grad) for (name, t), p in
                         zip(initial.items(), self.params.values(), strict=True)} for _ in range(2)]
        self.version = [0, 0]  # W(0) in both: batches 0 and 1 both run on it
        self.newest = 0
        with torch.no_grad():
            for name, param in self.params.items():
                param.data = self.buffers[0][name].detach()

    def slot(self, batch: int) -> int:
        return (batch - 1) % 2

    def leaves(self, batch: int) -> dict[str, torch.Tensor]:
        expected = max(batch - 1, 0)
        if self.version[self.slot(batch)] != expected:
            raise RuntimeError(f"batch {batch} needs weight version {expected} but its buffer holds "
                               f"{self.version[self.slot(batch)]}: more microbatches in flight than 2BW allows")
        return self.buffers[self.slot(batch)]

    @torch.no_grad()
    def advance(self, batch: int, optimizer: torch.optim.Optimizer, lr: float | None) -> None:
        """After batch t's last backward: W(t+1) = W(t) - lr * grad(W(t-1)), into batch t's buffer."""
        used, newest = self.buffers[self.slot(batch)], self.buffers[batch % 2]
        for name, param in self.params.items():
            grad, used[name].grad = used[name].grad, None
            used[name].copy_(newest[name])  # W(t), which the update turns into W(t+1)
            param.data = used[name].detach()
            param.grad = grad
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.version[self.slot(batch)] = batch + 1
        self.newest = batch + 1


class PipeDream2BW:
    """One rank's chunk of an asynchronous 1F1B pipeline with double-buffered weights.

    `module` runs `chunk` (plain module, one chunk per rank); `optimizer` updates its
    parameters; `lr_at(step)` gives the learning rate of global step `step` (None keeps the
    optimizer's). `pp` is the pipeline group or mesh["pp"].
    """

    def __init__(self, module: nn.Module, chunk: Chunk, optimizer: torch.optim.Optimizer, *,
                 pp, n_micro: int, micro_batch: int, seq_len: int, d_model: int,
                 lr_at: Callable[[int], float] | None = None):
        self.group = as_group(pp)
        self.pp_size, self.pp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if chunk.index != self.pp_rank:
            raise ValueError(f"PipeDream runs chunk c on pipeline rank c; rank {self.pp_rank} got chunk {chunk.index}")
        if n_micro < self.pp_size:
            raise ValueError(
                f"PipeDream-2BW needs at least pp={self.pp_size} microbatches per step to keep two weight "
                f"versions, got {n_micro}: raise train.global_batch or lower train.micro_batch"
            )
        cfg = getattr(module, "cfg", None)
        if self.pp_size > 1 and cfg is not None and cfg.tie_embeddings:
            raise ValueError(
                "PipeDream-2BW cannot tie embeddings across stages: summing the two copies' gradients "
                "would make the last stage wait for the first, the synchronisation it avoids; set "
                "model.tie_embeddings=false or use a synchronous schedule"
            )
        self.module, self.chunk, self.optimizer = module, chunk, optimizer
        self.n_micro, self.micro_batch, self.seq_len, self.d_model = n_micro, micro_batch, seq_len, d_model
        self.lr_at = lr_at
        # Stage boundaries travel on the module's device in its dtype (NCCL sends device tensors only).
        first_param = next(module.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        self.weights = DoubleBufferedWeights(module)
        self.uses: list[VersionUse] = []

    def stashed_weights(self) -> dict[str, torch.Tensor]:
        """W(t-1) after t updates: the version the next batch's gradient is computed on."""
        return {name: t.detach().clone() for name, t in self.weights.leaves(self.weights.newest).items()}

    def _peer(self, offset: int) -> int:
        return self.pp_rank + offset

    def run(self, batches: Sequence[Sequence[Batch]], tokens: Sequence[int], first_step: int = 0) -> list[float]:
        """Stream `batches` (one list of n_micro microbatches per global step) through the pipeline.

        `tokens[i]` is batch i's loss-token count. Returns each batch's loss (summed token
        loss / tokens, computed on its stale weights W(t-1)) on every rank of the pp group.
        Step numbers continue from `first_step`: the batch of global step t is batches[t - first_step].
        """
        if len(batches) != len(tokens):
            raise ValueError(f"{len(batches)} batches but {len(tokens)} token counts")
        micro = [pad_batch(b, self.seq_len) for step in batches for b in step]
        if len(micro) != len(batches) * self.n_micro:
            raise ValueError(f"every step needs {self.n_micro} microbatches")
        first, last = self.chunk.first, self.chunk.last
        self.uses = []
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        done = [0] * len(batches)
        loss_sums = torch.zeros(len(batches), dtype=torch.float64, device=self.device)
        for kind, k in one_f_one_b(self.pp_rank, self.pp_size, len(micro)):
            index = k // self.n_micro
            batch = first_step + index
            if kind == "F":
                x = micro[k].input_ids.to(self.device) if first else self._recv(-1, requires_grad=True)
                out = functional_call(self.module, self.weights.leaves(batch), (x,))
                if last:
                    part, _ = token_loss_sum(out, micro[k].labels.to(self.device))
                    loss_sums[index] += float(part.detach())
                    out = part / tokens[index]
                else:
                    pending_sends.append(self._send(out.detach(), 1))
                saved[k] = (None if first else x, out)
                self.uses.append(VersionUse(k, batch, self.weights.version[self.weights.slot(batch)], -1,
                                            self.weights.newest, -1))
                continue
            x, out = saved.pop(k)
            grad = None if last else self._recv(1)
            version = self.weights.version[self.weights.slot(batch)]
            torch.autograd.backward(out, grad)
            self._record_backward(k, version)
            if x is not None:
                pending_sends.append(self._send(x.grad, -1))
            done[index] += 1
            if done[index] == self.n_micro:
                self.weights.advance(batch, self.optimizer, self.lr_at(batch) if self.lr_at else None)
        for work, _tensor in pending_sends:
            work.wait()
        dist.all_reduce(loss_sums, group=self.group)  # only the last stage's entries are non-zero
        return [float(s) / n for s, n in zip(loss_sums, tokens, strict=True)]

    def _send(self, tensor: torch.Tensor, offset: int) -> tuple[dist.Work, torch.Tensor]:
        # Sends are not awaited until the end of the run (a blocking send could wait on a
        # peer that is itself blocked sending the other way); the tensor stays referenced.
        return dist.isend(tensor, group=self.group, group_dst=self._peer(offset)), tensor

    def _recv(self, offset: int, requires_grad: bool = False) -> torch.Tensor:
        buffer = torch.empty(self.micro_batch, self.seq_len, self.d_model, device=self.device, dtype=self.dtype)
        dist.recv(buffer, group=self.group, group_src=self._peer(offset))
        return buffer.requires_grad_(requires_grad)

    def _record_backward(self, micro: int, version: int) -> None:
        for i in range(len(self.uses) - 1, -1, -1):
            use = self.uses[i]
            if use.micro == micro and use.backward_version == -1:
                self.uses[i] = VersionUse(micro, use.batch, use.forward_version, version, use.newest_at_forward,
                                          self.weights.newest)
                return
        raise AssertionError(f"backward of microbatch {micro} without its forward")

