"""Engine step time per parallel layout (`python -m bench.engine`).

    main    the driver: layouts, launches of ranks, the table and the docs section
    worker  the rank side: every layout of one world size in one launch
"""
