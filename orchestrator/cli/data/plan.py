"""The plan of one preparation, and what to do with an output location that is not empty.

Protocol (driver only): `make_plan` builds the `Plan` from the checked sources and tokenizer;
`decide` compares it with what the output already holds and returns FRESH, RESUME or DONE,
or raises `UsageError` (the location holds something else: never mix two datasets). On
FRESH the driver creates `OUT/plan.json` exclusively before any task runs; on RESUME the
tasks skip every unit whose shard is complete (its `.done` marker, see `shard_task.py`);
on DONE there is nothing to do.

`plan.json` records the inputs with their sizes and versions (ETag or mtime), the tokenizer's
hash, the text field, the EOS id and the units. Two runs with equal plans write the same
bytes to the same shards, so a resumed run may take over from an interrupted one.
"""

from __future__ import annotations

import enum
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.cli.data.sources import Source
from orchestrator.cli.data.units import BYTES_PER_TOKEN, Unit, plan_units
from orchestrator.cli.data.vocab import TokenizerSpec
from orchestrator.cli.exits import UsageError
from trainer.tokens.format import TokenManifest, sha256_hex

PLAN_NAME = "plan.json"
FIX = "choose another --out, or delete it to start over"


class Plan(BaseModel):
    """`OUT/plan.json`: everything that determines the bytes of every shard."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["undying-tokens-plan"] = "undying-tokens-plan"
    version: int = 2  # 2: documents are never truncated or padded (special tokens: the two flags below)
    tokenizer: str
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    dtype: Literal["uint16", "uint32"]
    text_field: str
    shard_tokens: int
    # How each document is encoded (False in plans written before they were recorded: neither was done).
    add_special_tokens: bool = False  # the tokenizer's post-processor (a Llama tokenizer's BOS)
    parse_special_tokens: bool = False  # special tokens written in a document are their ids
    # An empty text is no document (records.iter_documents). False in plans written before: an empty
    # record was EOS alone; a run resuming such a plan keeps that, so one dataset never mixes the two.
    skip_empty_texts: bool = False
    sources: tuple[Source, ...]
    units: tuple[Unit, ...]

    @property
    def inputs(self) -> list[str]:
        return [s.url for s in self.sources]

    def identity(self) -> dict:
        """What must be equal for two runs to write the same shards: not where the tokenizer
        was read from (its hash counts) nor how the inputs were spelled (their URLs count); nor the
        release's rule for empty texts (a resumed run takes the plan's own, `skip_empty_texts`)."""
        return self.model_dump(mode="json", exclude={"tokenizer": True, "sources": {"__all__": {"arg"}},
                                                      "skip_empty_texts": True})

    def to_bytes(self) -> bytes:
        """As written; a plan of the release before `skip_empty_texts` (False) without it, so that its
        bytes, and the hash its finished units' markers record, stay what that release wrote."""
        legacy = {"skip_empty_texts"} if not self.skip_empty_texts else None
        return (json.dumps(self.model_dump(mode="json", exclude=legacy), indent=1) + "\n").encode()

    def sha256(self) -> str:
        return sha256_hex(self.to_bytes())


class Decision(enum.Enum):
    FRESH = "fresh"  # nothing there: write the plan, run every unit
    RESUME = "resume"  # an unfinished run of this very plan: run the units not done yet
    DONE = "done"  # a committed dataset of these inputs and this tokenizer: nothing to do


def make_plan(sources: list[Source], tokenizer: TokenizerSpec, text_field: str, shard_tokens: int,
              add_special_tokens: bool = False, parse_special_tokens: bool = False) -> Plan:
    return Plan(tokenizer=tokenizer.source, tokenizer_sha256=tokenizer.sha256, vocab_size=tokenizer.vocab_size,
                eos_id=tokenizer.eos_id, dtype=tokenizer.dtype, text_field=text_field, shard_tokens=shard_tokens,
                add_special_tokens=add_special_tokens, parse_special_tokens=parse_special_tokens,
                skip_empty_texts=True, sources=tuple(sources),
                units=tuple(plan_units(sources, shard_tokens * BYTES_PER_TOKEN)))


def parse_plan(data: bytes, where: str) -> Plan:
    try:
        return Plan.model_validate_json(data)
    except ValidationError as err:
        raise UsageError(f"--out: {where} is not a plan of this release ({err.errors()[0]['msg']}); {FIX}") from None


def decide(out: str, plan: Plan, manifest: TokenManifest | None, old_plan: Plan | None,
           other_entries: list[str]) -> Decision:
    """What to do at `out`, which holds `manifest` (committed), `old_plan` and `other_entries`
    (names that are neither). Raises UsageError, naming what differs, when it holds another dataset."""
    if manifest is not None:
        differs = _manifest_difference(manifest, plan) or (old_plan and _input_difference(old_plan, plan))
        if differs:
            raise UsageError(f"--out {out} already holds a dataset prepared from {differs}; {FIX}")
        return Decision.DONE
    if old_plan is not None:
        differs = _input_difference(old_plan, plan) or _plan_difference(old_plan, plan)
        if differs:
            raise UsageError(f"--out {out} holds an unfinished preparation of {differs}; {FIX}")
        return Decision.RESUME
    if other_entries:
        shown = ", ".join(other_entries[:3]) + (", ..." if len(other_entries) > 3 else "")
        raise UsageError(f"--out {out} is not empty ({shown}) and holds no {PLAN_NAME} of `undying data prepare`; "
                         "choose an empty or new location")
    return Decision.FRESH


def _manifest_difference(manifest: TokenManifest, plan: Plan) -> str:
    if manifest.inputs != plan.inputs:
        return f"other inputs ({_list(manifest.inputs)}, not {_list(plan.inputs)})"
    if manifest.tokenizer_sha256 != plan.tokenizer_sha256:
        return f"another tokenizer ({manifest.tokenizer}, SHA-256 {manifest.tokenizer_sha256[:12]}...)"
    if manifest.text_field != plan.text_field:
        return f"another text field ({manifest.text_field!r}, not {plan.text_field!r})"
    if manifest.eos_id != plan.eos_id:
        return f"another end-of-document token (id {manifest.eos_id}, not {plan.eos_id})"
    return _encoding_difference(manifest, plan)


def _input_difference(old: Plan, new: Plan) -> str:
    """Which input changed (a file added, removed, grown or modified) between two plans."""
    if old.inputs != new.inputs:
        return f"other inputs ({_list(old.inputs)}, not {_list(new.inputs)})"
    for a, b in zip(old.sources, new.sources, strict=True):
        if a.files != b.files:
            return f"another version of input {b.arg} (it changed since: size or modification time differ)"
    return ""


def _plan_difference(old: Plan, new: Plan) -> str:
    if old.version != new.version:
        return f"an older version of `undying data prepare` (plan version {old.version}, not {new.version})"
    for field, label in (("tokenizer_sha256", "another tokenizer"), ("text_field", "another --text-field"),
                         ("eos_id", "another end-of-document token"), ("shard_tokens", "another --shard-tokens")):
        if getattr(old, field) != getattr(new, field):
            return f"{label} ({getattr(old, field)!r}, not {getattr(new, field)!r})"
    if _encoding_difference(old, new):
        return _encoding_difference(old, new)
    if old.identity() != new.identity():
        return "another plan (the units differ)"
    return ""


def _encoding_difference(old: Plan | TokenManifest, new: Plan) -> str:
    """Which encoding flag differs between what is there and this run's plan."""
    for field, flag in (("add_special_tokens", "--add-special-tokens"),
                        ("parse_special_tokens", "--parse-special-tokens")):
        if getattr(old, field) != getattr(new, field):
            was, now = ("on", "off") if getattr(old, field) else ("off", "on")
            return f"{flag} {was} (this run's is {now})"
    return ""


def _list(items: list[str], shown: int = 3) -> str:
    text = ", ".join(items[:shown])
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")
