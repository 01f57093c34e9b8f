"""A spare's first engine build and step, on a tiny twin of the job's model.

Called once by `RankActor.warm_up` (a spare, in the background, before any takeover). The
first engine build and the first training step of a process pay one-off costs that later ones
do not: the autograd engine's threads, the optimizer's fused kernels, the deterministic-mode
switches, CPU kernel selection (and on a GPU the CUDA context, cuBLAS handles and the caching
allocator). A spare that has not paid them pays them inside the recovery it takes over (on
the 4-rank CPU demo, its first step took 0.18 s against 0.10 s for the next one).

The twin keeps what selects kernels (architecture: activation, positions, norm, tied
embeddings; precision, optimizer, determinism, compile) and shrinks every dimension, so
the warm-up costs milliseconds and a few KB whatever the job's size; it trains one step on
synthetic data in this process alone (one rank, no process group), then is dropped (with
`train.compile`, its compiled graphs too: torch._dynamo.reset()).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)
TWIN_DIMS = {"vocab_size": 256, "n_layers": 1, "d_model": 32, "d_ff": 64, "n_heads": 2, "max_seq_len": 16,
             "from_hf": None, "preset": None}
TWIN_SEQ_LEN = 8


def tiny_twin(model, train):
    """(model, data, train, parallel) configs of the twin of `model` / `train` (the spec's)."""
    from trainer.config import DataConfig, ParallelConfig

    kv_heads = 1 if model.n_kv_heads is not None and model.n_kv_heads < model.n_heads else 2
    twin = model.model_copy(update={**TWIN_DIMS, "n_kv_heads": kv_heads, "rope_scaling": None})
    data = DataConfig(source="synthetic", seq_len=TWIN_SEQ_LEN)
    steps = train.model_copy(update={"steps": 1, "global_batch": 1, "micro_batch": 1, "warmup_steps": 0})
    return twin, data, steps, ParallelConfig()


def warm_first_step(spec, device) -> float | None:
    """Build the twin on `device` and train it one step; returns the seconds it took, or None when
    the twin failed (logged: the spare stays a spare, warm to its imports; a takeover then pays the
    first build itself, as before)."""
    from trainer.engine import Engine

    started = time.perf_counter()
    try:
        model, data, train, parallel = tiny_twin(spec.model, spec.train)
        engine = Engine(model, data, train, parallel, rank=0, world_size=1, device=device.type)
        try:
            engine.train_step()
        finally:
            engine.data.close(wait=False)
            if train.compile:  # forget the twin's graphs: compiled at its shapes, they would make the real
                import torch._dynamo  # block's compile mark those dimensions dynamic (other kernels than
                torch._dynamo.reset()  # the ranks that never warmed ran); imports and compiler start-up stay paid
    except Exception as err:  # an optimisation only: never the reason a spare is lost
        log.warning("spare warm-up: the tiny twin of the model failed (%s: %s); the first engine build "
                    "will be paid at takeover", type(err).__name__, err)
        return None
    return time.perf_counter() - started
