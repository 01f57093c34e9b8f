"""Save torture: a process doing a real checkpoint save SIGKILLed at random points never leaves a bad
checkpoint that loads (`python -m bench.torture --points 50`).

    main    the bench: the kill points per backend, the checks after each kill, the table, the JSON
            and the docs section
    checks  what is checked after a kill, counted rather than asserted
"""
