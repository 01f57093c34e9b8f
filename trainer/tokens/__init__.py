"""Tokenized datasets: the on-storage format (`format.py`) and its reader (`reader.py`).

`undying data prepare` (orchestrator/cli/data/) writes a dataset; a training data loader
opens it with `TokenDataset(url)` and reads token ranges from any thread.
"""

from trainer.tokens.format import (
    NoManifest,
    ShardEntry,
    TokenFormatError,
    TokenManifest,
    dtype_for_vocab,
    shard_name,
)
from trainer.tokens.reader import TokenDataset

__all__ = ["NoManifest", "ShardEntry", "TokenDataset", "TokenFormatError", "TokenManifest", "dtype_for_vocab",
           "shard_name"]
