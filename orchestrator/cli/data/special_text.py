"""A look at the first documents before tokenizing: special-token text that `--parse-special-tokens` would read.

Called by the driver (`prepare.py`) once a fresh or resumed plan is settled, when the plan
keeps special tokens as text (the default). Chat-formatted data (a chat template's
`<|start_header_id|>user<|end_header_id|>...<|eot_id|>`) writes its markup as special tokens;
tokenized as characters, the model never sees those ids, and a fine-tune's exported
generation config would stop at an id it never learned to emit. Web text that merely names
`</s>` is rarer: a sample finds the first case, and the warning names the token, the record
and the flag. Only the first unit's first documents are read, so the look costs one small read.
"""

from __future__ import annotations

import itertools
import re

from orchestrator.cli.data.plan import Plan
from orchestrator.cli.data.records import iter_documents

SAMPLE_DOCUMENTS = 200


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
        found = pattern.search(text)
        if found:
            return (f"INPUT {arg}: {where} writes the special token {found.group()!r} as text, which is tokenized "
                    "as its characters; for chat-formatted data whose markup is special tokens, pass "
                    "--parse-special-tokens (and --out a new location)")
    return None


def _documents(plan: Plan, storage_options: dict):
    """(input, text, where) of the first unit's documents, in stream order, read lazily."""
    for piece in plan.units[0].pieces:
        source = plan.sources[piece.source]
        for text, where in iter_documents(source, source.files[piece.file], piece, plan.text_field, storage_options):
            yield source.arg, text, where
