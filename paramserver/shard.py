"""One server's shard: its slices of the parameters, their optimizer state, the consistency rule.

Protocol (a server actor, paramserver.actors, drives one `ShardServer` from one event loop;
nothing here blocks or is thread-safe):
  1. `may_read(step)` until true, then `pull(worker, step, rows)`: the shard's values now.
  2. `push(push)` once per (worker, step), in each worker's step order. bsp keeps the step's
     pushes until all `workers` are in, then applies their token-weighted mean as one update
     (equal to collective dp's); ssp and asp apply each push at once, as that worker's mean.
Every applied push leaves an `UpdateRecord` (version pulled, version applied).

The dense slices are updated by the engine's own optimizer (trainer.optim.build_optimizer, lr
from trainer.optim.lr_at at the pushing step), over a ParameterList of the slices: AdamW's
arithmetic is per element, so a slice of a tensor updates exactly as the whole tensor would.
Sparse slices (the untied embedding under ssp / asp) use lazy updates (paramserver.sparse).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ckpt.storage_errors import DEFAULT_READ_RETRY_S, ReadRetry
from paramserver.clocks import Clocks, UpdateRecord, ahead_limit
from paramserver.messages import Pulled, Push
from paramserver.partition import param_name
from paramserver.sparse import RowState, lazy_update_
from trainer.config import ModelConfig, TrainConfig
from trainer.dtensor_slices import optimizer_fields
from trainer.init_values import fill_slice, param_std
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.state_slices import TensorSlice


class NotAtCut(RuntimeError):
    """A save asked of a server whose state is not that of the cut (ShardServer.check_cut): the
    supervisor's segment did not end where it meant to. Not a storage failure: the segment is
    rolled back (paramserver.supervisor)."""


def initial_values(piece: TensorSlice, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The slice's initial values, bit-identical to the same elements of trainer.model.build_model."""
    out = torch.empty(piece.lengths, dtype=piece.dtype)
    name = param_name(piece)
    std = param_std(cfg, name)
    if std is None:
        return out.fill_(1.0)
    fill_slice(out, seed, name, std, piece.global_shape, piece.offsets)
    return out


def starting_values(slices: list[TensorSlice], cfg: ModelConfig, seed: int, read_retry_s: float) -> list[torch.Tensor]:
    """The slices' values at step 0: `model.from_hf`'s weights for a fine-tune (each slice's bytes
    alone, read with `read_retry_s` for the store's transient failures), else `initial_values`."""
    if not cfg.from_hf:
        return [initial_values(piece, cfg, seed) for piece in slices]
    from ckpt.hf_import import read_hf_slices  # a fine-tune's only: the safetensors reader

    # Each slice gets its own tensor to be filled (cast to its dtype), never a view of the fetched bytes.
    wanted = [replace(piece, tensor=torch.empty(piece.lengths, dtype=piece.dtype)) for piece in slices]
    read = read_hf_slices(cfg.from_hf, wanted, cfg, storage_options=cfg.storage_options,
                          retry=ReadRetry(read_retry_s))
    return [piece.tensor for piece in read]


class ShardServer:
    def __init__(self, index: int, slices: list[TensorSlice], model: ModelConfig, train: TrainConfig,
                 workers: int, consistency: str, staleness: int | None = None,
                 sparse_names: frozenset[str] = frozenset(), read_retry_s: float = DEFAULT_READ_RETRY_S):
        self.index, self.slices, self.model, self.train, self.workers = index, slices, model, train, workers
        self.limit, self.aggregate = ahead_limit(consistency, staleness), consistency == "bsp"
        self.params = [nn.Parameter(value) for value in starting_values(slices, model, train.seed, read_retry_s)]
        self.sparse = {i for i, s in enumerate(slices) if param_name(s) in sparse_names}
        self.dense = [i for i in range(len(slices)) if i not in self.sparse]
        dense_params = nn.ParameterList([self.params[i] for i in self.dense])
        self.optimizer = build_optimizer(dense_params, train) if self.dense else None
        self.row_state = {i: RowState() for i in self.sparse}
        self.clocks = Clocks(workers)
        self.version = 0
        self.pending: dict[int, dict[int, Push]] = {}
        self.records: list[UpdateRecord] = []  # applied since its actor's last `stats` call took them
        self.bytes_in = self.bytes_out = 0

    def may_read(self, step: int) -> bool:
        return self.clocks.may_read(step, self.limit)

    @torch.no_grad()
    def pull(self, worker: int, step: int, rows: torch.Tensor | None = None) -> Pulled:
        """The shard's values; for sparse slices only `rows` (global row ids; None: all rows)."""
        assert self.may_read(step), f"worker {worker} pulled step {step} before the bound allowed it"
        out = Pulled(self.index, self.version, self.clocks.slowest)
        for i, (piece, param) in enumerate(zip(self.slices, self.params, strict=True)):
            if i in self.sparse and rows is not None:
                mine = _rows_in(rows, piece)
                out.sparse[i] = (mine, param[mine - piece.offsets[0]].clone())
            else:
                out.dense[i] = param.detach().clone()
        self.bytes_out += out.nbytes
        return out

    def push(self, push: Push) -> None:
        self.clocks.tick(push.worker, push.step)
        self.bytes_in += push.nbytes
        if not self.aggregate:
            self._apply([push], push.step)
            return
        # bsp: the step's update waits for every worker's gradient.
        waiting = self.pending.setdefault(push.step, {})
        waiting[push.worker] = push
        if len(waiting) == self.workers:
            del self.pending[push.step]
            self._apply([waiting[w] for w in sorted(waiting)], push.step)

    @torch.no_grad()
    def _apply(self, pushes: list[Push], step: int) -> None:
        tokens = sum(p.tokens for p in pushes)
        lr = lr_at(step, self.train)
        if self.optimizer is not None:
            for i in self.dense:
                # Summed in worker order: the same sum whatever order the pushes arrived in.
                total = pushes[0].dense[i].clone()
                for other in pushes[1:]:
                    total.add_(other.dense[i])
                self.params[i].grad = total.div_(tokens)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            for i in self.dense:
                self.params[i].grad = None
        for i in self.sparse:
            for p in pushes:
                rows, values = p.sparse.get(i, (torch.empty(0, dtype=torch.long), None))
                decay = self.train.weight_decay if self.params[i].ndim >= 2 else 0.0
                lazy_update_(self.params[i].data, rows - self.slices[i].offsets[0],
                             values / p.tokens if values is not None else None, self.row_state[i],
                             self.train, lr, decay)
        for p in pushes:
            self.records.append(UpdateRecord(self.index, p.worker, p.step, p.pulled_version, self.version,
                                             p.slowest_at_pull))
        self.version += 1

    def state_slices(self) -> list[TensorSlice]:
        """The shard's state as slices of the logical tensors a collective job saves (CPU copies):
        `model/<name>` and `optim/<name>/<field>` (trainer.state_slices). A row band's optimizer
        fields have its geometry; the scalar `step` is reported by the band at row 0 only (every
        server counts the same dense updates). A sparse band reports its moments once the server
        has updated anything (zeros where no row was touched yet, as lazy Adam would create them),
        and its own update count per row as `optim/<name>/lazy_step` (bands count their own sparse
        updates; the scalar `step` is the row-0 band's, what a dense optimizer loads)."""
        out = []
        for i, (piece, param) in enumerate(zip(self.slices, self.params, strict=True)):
            out.append(piece.with_tensor(param.detach().clone()))
            if i in self.sparse:
                fields = self._sparse_fields(i)
                step = self.row_state[i].step if fields else None
                if fields:
                    steps = torch.full(piece.lengths[:1], step, dtype=torch.int64)
                    out.append(TensorSlice(lazy_step_name(param_name(piece)), torch.int64, piece.global_shape[:1],
                                           piece.offsets[:1], piece.lengths[:1], tensor=steps))
            else:
                state = self.optimizer.state.get(param, {})
                fields = {k: v for k, v in state.items() if k != "step"}
                step = state.get("step")
            name = param_name(piece)
            for field, value in sorted(fields.items()):
                out.append(replace(piece, name=f"optim/{name}/{field}", tensor=value.detach().clone()))
            if step is not None and not any(piece.offsets):
                value = torch.as_tensor(step, dtype=torch.float32).detach().clone()
                out.append(TensorSlice(f"optim/{name}/step", value.dtype, (), (), (), tensor=value))
        return out


    def _sparse_fields(self, i: int) -> dict[str, torch.Tensor]:
        """Sparse slice `i`'s optimizer fields, none before the server's first update (so a
        checkpoint of version 0 holds no optimizer state, as the engine's before its first step)."""
        state = self.row_state[i]
        if self.version == 0 and state.step == 0:
            return {}
        names = [f for f in optimizer_fields(self.train.optimizer, self.train.betas) if f != "step"]
        return {f: state.fields.get(f, torch.zeros_like(self.params[i])) for f in names}

    def check_cut(self, step: int) -> None:
        """Raise NotAtCut unless the shard holds the state of step `step` exactly: every worker has pushed
        `step` steps here and no bsp step waits for pushes (a consistent cut, docs/design.md)."""
        if self.clocks.pushed != [step] * self.workers or self.pending:
            raise NotAtCut(f"server {self.index} is not at step {step}: its workers have pushed "
                             f"{self.clocks.pushed} steps and steps {sorted(self.pending)} wait for pushes; save "
                             "between segments, once every worker has pushed exactly that many steps")

    @torch.no_grad()
    def restore(self, given: dict[tuple, TensorSlice], step: int, clock: int | None = None) -> int:
        """Load this shard's state at checkpointed step `step` from `given` ((name, offsets) -> slice in
        this shard's geometry, read by paramserver.checkpoint); the parameters already hold their values
        (filled in place). The optimizer state is that of `given`, reset when it holds none; the
        worker clocks restart at `clock` (default `step`); the version becomes the one the server had
        at that cut (bsp: one update per step; ssp and asp: one per push). Returns the version."""
        fields = [f for f in optimizer_fields(self.train.optimizer, self.train.betas) if f != "step"]
        with_optim = any(name.startswith("optim/") for name, _ in given)
        if self.optimizer is not None:
            self.optimizer.state.clear()
        for i, (piece, param) in enumerate(zip(self.slices, self.params, strict=True)):
            name = param_name(piece)
            at = piece.offsets
            values = {f: given[f"optim/{name}/{f}", at].tensor.clone() for f in fields} if with_optim else {}
            scalar = given.get((f"optim/{name}/step", ()))
            if i in self.sparse:
                lazy = given.get((lazy_step_name(name), at[:1]))
                count = lazy.tensor.max() if lazy is not None else scalar.tensor if scalar is not None else step
                self.row_state[i] = RowState(values, int(count) if values else 0)
            elif with_optim:
                if scalar is not None:
                    values["step"] = scalar.tensor.clone().to(torch.float32)
                self.optimizer.state[param] = values
        self.clocks.pushed = [step if clock is None else clock] * self.workers
        self.pending.clear()
        self.version = step if self.aggregate else step * self.workers
        return self.version


def lazy_step_name(name: str) -> str:
    """The logical tensor of a sparse parameter's per-row update counts (ps checkpoints only)."""
    return f"optim/{name}/lazy_step"


def _rows_in(rows: torch.Tensor, piece: TensorSlice) -> torch.Tensor:
    start = piece.offsets[0]
    return rows[(rows >= start) & (rows < start + piece.lengths[0])]
