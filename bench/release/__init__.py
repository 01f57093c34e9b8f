"""Release from a broken collective: how fast every survivor leaves it when a rank dies (`python -m bench.release`).

    main      the bench: every scenario, the table, the JSON and the docs section
    scenario  one scenario: W rank processes, the kill, the survivors' release and re-form
"""
