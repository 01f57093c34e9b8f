"""A look at the first documents before tokenizing: special-token text that `--parse-special-tokens` would read.

Called by the driver (`prepare.py`) once a fresh or resumed plan is settled, when the plan
keeps special tokens as text (the default). Chat-formatted data (a chat template's
`<|start_header_id|>user<|end_header_id|>...<|eot_id|>`) writes its markup as special tokens;
tokenized as characters, the model never sees those ids, and a fine-tune's exported
generation config would stop at an id it never learned to emit. Web text that merely names
`</s>` is rarer: a sample finds the first case, and the warning names the token, the record
and the flag. Only the first unit's first documents are read (a .txt file's first MiB), so the
look costs a small read (a .parquet's first row group).
"""

from __future__ import annotations

import itertools
import re

from orchestrator.cli.data.plan import Plan
from orchestrator.cli.data.records import iter_documents
from orchestrator.cli.data.sources import open_fs

SAMPLE_DOCUMENTS = 200
SAMPLE_CHARS = 2**20  # of each document looked at


def special_token_text(plan: Plan, tokenizer, storage_options: dict) -> str | None:
    """A warning naming the first special token written in the first SAMPLE_DOCUMENTS documents, or
    None (none found, no special tokens, or special tokens are parsed). `tokenizer`: a
    `tokenizers.Tokenizer` of the plan's tokenizer."""
    specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
                      key=len, reverse=True)
    if plan.parse_special_tokens or not specials or not plan.units:
        return None
    pattern = re.compile("|".join(re.escape(token) for token in specials))
    try:
        sample = list(itertools.islice(_documents(plan, storage_options), SAMPLE_DOCUMENTS))
    except Exception:  # noqa: BLE001 (a bad record, the store: the tasks read it too and report it as theirs)
        return None
    for arg, text, where in sample:
        found = pattern.search(text, 0, SAMPLE_CHARS)
        if found:
            return (f"INPUT {arg}: {where} writes the special token {found.group()!r} as text, which is tokenized "
                    "as its characters; for chat-formatted data whose markup is special tokens, pass "
                    "--parse-special-tokens (and --out a new location)")
    return None


def _documents(plan: Plan, storage_options: dict):
    """(input, text, where) of the first unit's documents, in stream order, read lazily: a .txt
    file (one document, of any size) only its first SAMPLE_CHARS."""
    for piece in plan.units[0].pieces:
        source, file = plan.sources[piece.source], plan.sources[piece.source].files[piece.file]
        if source.kind == "txt":
            fs, path = open_fs(file.url, storage_options)
            with fs.open(path, "rb") as f:
                yield source.arg, f.read(SAMPLE_CHARS).decode("utf-8", errors="replace"), "the file"
            continue
        for text, where in iter_documents(source, file, piece, plan.text_field, storage_options):
            yield source.arg, text, where
