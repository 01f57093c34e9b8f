"""Recovery speed of undying vs Ray Train vs torchrun (`python -m bench.recovery`).

    main      the driver: the job, the runs, the tables and the docs section
    systems   runs one system once with the kill and turns its records into numbers
    worker    the Ray Train and torchrun training processes (`python -m bench.recovery.worker ROLE --config JSON`)
    ray_head  a private local Ray head (also used by bench.goodput)
"""
