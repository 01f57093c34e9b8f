"""Checkpoint save and load: undying's writer/reader vs torch.distributed.checkpoint (`python -m bench.ckpt`).

    main        the driver: starts the ranks (and a SeaweedFS server), prints and writes the results
    controller  the driver's controller half: collects the ranks' receipts, commits the manifests
    worker      one rank process (`python -m bench.ckpt.worker CONFIG.json`)
    ops         the timed operations every rank runs, in the order of `plan`
    state       the sharded state the ranks save and load
    tvp         thread vs process background writer, on rank 0
    report      reductions, tables and targets
    section     the docs/benchmarks.md section
"""
