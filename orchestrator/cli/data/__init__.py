"""`undying data`: preparing training data on Ray Data.

`command.py` parses the arguments; `prepare.py` is the driver (check, plan, run, commit);
`sources.py`, `vocab.py` and `units.py` check the inputs and the tokenizer and cut the work
into units; `plan.py` decides what an existing output means (fresh, resume, done, refuse);
`shard_task.py` is one task (read, tokenize, write one shard); `records.py` reads the
documents of an input; `execute.py` runs the tasks (Ray Data, or in-process) and prints
progress. The format itself is `trainer/tokens/format.py`.
"""
