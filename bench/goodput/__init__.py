"""Goodput under the same random failures: undying vs Ray Train (`python -m bench.goodput`).

    main    the driver: the kill schedule, both systems on one Ray head, the table and the docs section
    worker  the Ray Train driver and training function (`python -m bench.goodput.worker --config JSON`)
    sweep   the docs section of an `undying chaos sweep` result
"""
