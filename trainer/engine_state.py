"""The engine's training state as slices of logical tensors, for every layout (`Engine`'s state methods).

Names are logical and the same in every layout: "model/<param>" and "optim/<param>/<field>"
(AdamW: exp_avg, exp_avg_sq, step; SGD: momentum_buffer), parameter names those of
trainer.model. Each rank reports the pieces it holds (trainer.dtensor_slices describes where
they sit); a checkpoint saved in one layout loads into any other, because a loader reads each
wanted slice out of whatever pieces were stored.

Protocol (see trainer/state_slices.py): between steps, on any rank, no collectives:
`state_slices()` + `state_meta()` to save; `wanted_slices()`, then `load_slices(slices, meta)`
with the data filled in, to restore. `state_tensors()` / `load_state()` are the whole-tensor
form, for layouts where every rank holds every tensor whole (zero 0 or dp 1, tp 1, pp 1).

Pipeline parallelism with tied embeddings: the last chunk's copy of `tok_emb.weight`
(`ParamLayout.copy`) is never saved, since the first chunk's is the logical tensor, but it is
wanted, and `load_slices` fills it, parameter and optimizer state, from the same entries as
the original. A checkpoint therefore holds each logical tensor once and moves between pp
degrees (and into pp = 1) unchanged.
"""

from __future__ import annotations

import json
import logging

import torch

from trainer.checkpoint_match import CheckpointMismatch
from trainer.dtensor_slices import fresh_field, local, optimizer_fields
from trainer.optim import keeps_step_on_device, lr_at
from trainer.state_slices import TensorSlice

log = logging.getLogger(__name__)

STATE_FORMAT = "undying.trainer/1"


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    return local(tensor).detach().to("cpu", copy=True).contiguous()


def _view(tensor: torch.Tensor) -> torch.Tensor:
    return local(tensor).detach()


class EngineState:
    """Mixed into `Engine`; uses its `layouts`, `local_optimizer`, configs, `scaler`, `next_step`."""

    def _fields(self) -> list[str]:
        return optimizer_fields(self.train_config.optimizer, self.train_config.betas)

    def state_slices(self, copy: bool = True) -> list[TensorSlice]:
        """This rank's pieces of the training state: CPU copies (safe to write in the background),
        or with `copy=False` views of the live local tensors, for a caller that copies only what
        it keeps (the checkpoint writer stages just the slices this rank writes).

        Before the first step the optimizer has no state yet and none is reported.
        """
        take = _snapshot if copy else _view
        out = []
        optim_state = self.local_optimizer.state
        for layout in self.layouts:
            if layout.copy:
                continue
            if not layout.geometry.empty:
                value = take(layout.param)
                out.append(layout.geometry.slice(f"model/{layout.name}", value.dtype, value))
            if layout.optim is None:
                continue
            for field, value in optim_state.get(layout.param, {}).items():
                geometry = layout.step if field == "step" else layout.optim
                if not geometry.empty:
                    value = take(value)
                    out.append(geometry.slice(f"optim/{layout.name}/{field}", value.dtype, value))
        return out

    def wanted_slices(self) -> list[TensorSlice]:
        """The geometry `load_slices` needs, without data; optimizer state even before the first step.

        Each name once: a rank holding both copies of a tied embedding (pipeline V placement)
        holds the same slice of each, and one entry fills both.
        """
        wanted: dict[str, TensorSlice] = {}

        def want(piece: TensorSlice) -> None:
            seen = wanted.setdefault(piece.name, piece)
            if seen.key != piece.key:
                raise RuntimeError(f"{piece.name}: this rank holds two different slices of it")

        for layout in self.layouts:
            if not layout.geometry.empty:
                want(layout.geometry.slice(f"model/{layout.name}", layout.local.dtype))
            if layout.optim is None:
                continue
            for field in self._fields():
                geometry = layout.step if field == "step" else layout.optim
                if not geometry.empty:
                    want(geometry.slice(f"optim/{layout.name}/{field}", torch.float32))
        return list(wanted.values())

    def load_weights(self, slices: list[TensorSlice]) -> None:
        """Set the model parameters from `slices` (pretrained weights; every "model/" slice this rank
        holds, nothing else). Optimizer state, step and scaler stay as built: training starts at
        step 0 from these weights. Raises ValueError when a slice is missing or does not fit."""
        wanted = {piece.name: piece for piece in self.wanted_slices() if piece.name.startswith("model/")}
        given = {piece.name: piece for piece in slices}
        if set(given) != set(wanted):
            raise ValueError(f"pretrained weights do not match the model: missing {sorted(set(wanted) - set(given))}"
                             f", unexpected {sorted(set(given) - set(wanted))}")
        for name, piece in given.items():
            if piece.key != wanted[name].key or piece.tensor is None:
                raise ValueError(f"{name}: got slice {piece.offsets}+{piece.lengths}, this rank holds "
                                 f"{wanted[name].offsets}+{wanted[name].lengths}")
        with torch.no_grad():
            for layout in self.layouts:
                name = f"model/{layout.name}"
                if name in given:
                    layout.local.copy_(given[name].tensor)

    def load_slices(self, slices: list[TensorSlice], meta: dict) -> None:
        """Copy the wanted slices (data read from any stored layout) into this rank's state.

        Parameters and optimizer state both; a checkpoint without optimizer state (saved
        before the first step) resets it. Raises ValueError if the slices do not fit.
        """
        self._check_meta(meta)
        wanted = {piece.name: piece for piece in self.wanted_slices()}
        given = {piece.name: piece for piece in slices}
        unexpected = sorted(set(given) - set(wanted))
        missing = sorted(name for name in wanted if name not in given and name.startswith("model/"))
        with_optim = [name for name in given if name.startswith("optim/")]
        if with_optim:
            missing += sorted(name for name in wanted if name not in given and name.startswith("optim/"))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
        for name, piece in given.items():
            want = wanted[name]
            if piece.key != want.key or piece.global_shape != want.global_shape or piece.tensor is None:
                raise ValueError(f"{name}: got slice {piece.offsets}+{piece.lengths} of {piece.global_shape}"
                                 f" (data: {piece.tensor is not None}), this rank holds {want.offsets}+"
                                 f"{want.lengths} of {want.global_shape}")
        optimizer = self.local_optimizer
        with torch.no_grad():
            for layout in self.layouts:
                name = f"model/{layout.name}"
                if name in given:
                    layout.local.copy_(given[name].tensor)
                layout.param.grad = None
            for param in list(optimizer.state):
                del optimizer.state[param]
            if with_optim:
                for layout in self.layouts:
                    if layout.optim is not None:
                        optimizer.state[layout.param] = self._restored_fields(layout, given)
        self.next_step = int(meta["next_step"])
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state(meta["scaler"])
        saved, here = meta.get("precision"), self.train_config.precision  # (absent from older checkpoints)
        if saved is not None and saved != here and self.rank == 0:
            log.warning("resuming a checkpoint trained in %s with train.precision %s: %s", saved, here,
                        _precision_change(saved, here))

    def _restored_fields(self, layout, given: dict) -> dict:
        fields = {}
        on_device = keeps_step_on_device(self.local_optimizer)
        for field in self._fields():
            value = fresh_field(layout.param, field, on_device)
            piece = given.get(f"optim/{layout.name}/{field}")
            if piece is not None:
                local(value).copy_(piece.tensor)
            fields[field] = value
        return fields

    def _require_whole(self, what: str) -> None:
        if not self.whole_state:
            pc = self.parallel_config
            raise ValueError(
                f"{what} needs every rank to hold whole tensors (parallel.zero=0 or dp=1, and tp=pp=1); this "
                f"layout (dp={pc.dp}, tp={pc.tp}, pp={pc.pp}, zero={pc.zero}) shards them: use state_slices() / "
                "load_slices()"
            )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The whole training state as named CPU tensors (copies); whole-tensor layouts only."""
        self._require_whole("state_tensors()")
        return {piece.name: piece.tensor for piece in self.state_slices()}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore a state saved by `state_tensors` + `state_meta`, possibly from another dp degree.

        Every rank calls it with the same checkpoint, between steps. The tensors are copied,
        never aliased. Raises ValueError if the checkpoint does not fit this engine.
        """
        self._require_whole("load_state()")
        self._check_meta(meta)
        params = {layout.name: layout.param for layout in self.layouts}
        _check_whole(tensors, params)
        wanted = self.wanted_slices()
        self.load_slices([w.with_tensor(tensors[w.name]) for w in wanted if w.name in tensors], meta)

    def state_meta(self) -> dict:
        """The JSON-able rest of the state: the cursor (next_step), seeds, loss scaler and the layout."""
        tc, pc = self.train_config, self.parallel_config
        return {
            "format": STATE_FORMAT,
            "next_step": self.next_step,
            "data_seed": self.data_config.seed,
            "train_seed": tc.seed,
            "global_batch": tc.global_batch,
            "optimizer": tc.optimizer,
            "data": self.data.identity(),  # which tokens each step's samples are (with data_seed)
            # The schedule is a pure function of the step; its next value is informational.
            "lr": lr_at(self.next_step, tc),
            "scaler": None if self.scaler is None else self.scaler.state(),
            "precision": tc.precision,
            "layout": {"dp": pc.dp, "dp_replicate": pc.dp_replicate, "tp": pc.tp, "pp": pc.pp, "zero": pc.zero,
                       "micro_batch": tc.micro_batch, "world_size": self.world_size},
        }

    def _check_meta(self, meta: dict) -> None:
        if meta.get("format") != STATE_FORMAT:
            raise CheckpointMismatch(f"state format {meta.get('format')!r} is not {STATE_FORMAT!r}")
        expected = {"data_seed": self.data_config.seed, "global_batch": self.train_config.global_batch,
                    "optimizer": self.train_config.optimizer}
        if self.model_config.dropout > 0:  # after a restore train.seed draws only the dropout masks
            expected["train_seed"] = self.train_config.seed
        for key, value in expected.items():
            if meta.get(key) != value:
                raise CheckpointMismatch(
                    f"checkpoint has {key}={meta.get(key)!r} but this run has {value!r}: "
                    "resuming would change the training trajectory"
                )
        saved, here = meta.get("data"), self.data.identity()  # absent from checkpoints of older releases
        if saved is not None and saved != here:
            raise CheckpointMismatch(
                f"checkpoint was trained on data {json.dumps(saved)} but this run's data section gives "
                f"{json.dumps(here)}: resuming would repeat some samples and skip others; resume with the "
                "checkpoint's data section (source, path or mixture and its weights, seq_len, the same prepared "
                "datasets), or start the new data under another job name"
            )
        if int(meta.get("next_step", -1)) < 0:
            raise ValueError(f"checkpoint next_step={meta.get('next_step')!r} is not a step number")


def _check_whole(tensors: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> None:
    """Names and shapes of a whole-tensor checkpoint against the model's parameters."""
    missing = sorted(f"model/{name}" for name in params if f"model/{name}" not in tensors)
    unexpected, optim_params = [], set()
    for key, value in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "model" and rest in params:
            if tuple(value.shape) != tuple(params[rest].shape):
                raise ValueError(f"{key} has shape {tuple(value.shape)}, the model {tuple(params[rest].shape)}")
            continue
        name, _, _field = rest.rpartition("/")
        if kind == "optim" and name in params:
            optim_params.add(name)
        else:
            unexpected.append(key)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {sorted(unexpected)}")
    if optim_params and len(optim_params) != len(params):
        raise ValueError(f"optimizer state covers {len(optim_params)} of {len(params)} parameters")


def _precision_change(saved: str, here: str) -> str:
    """What resuming a checkpoint trained in `saved` under train.precision `here` changes."""
    if saved == "fp16":
        return "its fp16 loss scale is dropped"
    if here == "fp16":
        return "the loss scale starts at 2^16"
    return "the forward rounds otherwise; weights and optimizer state stay fp32"
