"""The benchmarks, one package each, run from the repository root as `python -m bench.<name>`.

    ckpt       checkpoint save and load: undying's writer/reader vs torch.distributed.checkpoint
    engine     engine step time per parallel layout
    goodput    goodput under the same random failures: undying vs Ray Train
    recovery   recovery speed: undying vs Ray Train vs torchrun
    release    release of the survivors from a broken collective
    gpu_check  the prepared GPU check (NCCL, bf16 steps, MFU, checkpoint staging)
    ps         parameter server (bsp, ssp, asp) vs collective data parallelism: bytes, loss vs wall time

Each writes its own section of docs/benchmarks.md with `bench.docs.replace_section`.
"""
