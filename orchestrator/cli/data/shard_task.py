"""One preparation task: tokenize one work unit and write it as one shard.

`run_unit(job, index)` runs in a Ray Data task (or in-process for tests), once per unit,
any number at a time, in any order. It writes `shard-NNNNNN.tokens`, then `.docs`, then
`.done`: a JSON marker with both files' checksums and the plan's hash, written only
after both files are complete. A unit whose marker matches the plan and whose files still
hash to the recorded checksums is not tokenized again (a resumed run); anything else is
redone from scratch, and since the bytes of a shard are a function of the plan alone, a
redo writes the same bytes. The result (counts and checksums, or the error) goes back to
the driver, which writes the manifest once every unit has one.

Each document is encoded as the plan says (with the tokenizer's post-processor, e.g. a Llama
tokenizer's BOS first, under `add_special_tokens`; special tokens written in it as their ids under
`parse_special_tokens`, else as their characters) and followed by the EOS id, unless the
post-processor already ended it with that id.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import asdict, dataclass

import numpy as np

from ckpt.storage import Storage
from ckpt.storage_options import error_reason
from orchestrator.cli.ckpt_cmd import is_storage_error
from orchestrator.cli.data.plan import Plan
from orchestrator.cli.data.records import BadRecord, iter_documents
from orchestrator.cli.data.sources import options_for
from orchestrator.cli.data.units import Unit
from orchestrator.cli.data.vocab import build_tokenizer
from trainer.tokens.format import (
    DOCS_SUFFIX,
    TOKENS_SUFFIX,
    ShardEntry,
    encode_shard,
    numpy_dtype,
    sha256_hex,
    shard_entry,
    shard_name,
)

DONE_SUFFIX = ".done"
# Documents are encoded in batches (the tokenizer parallelises a batch across its own
# threads) of bounded text, so memory stays near the shard's own size.
BATCH_DOCS, BATCH_BYTES = 1024, 8 * 2**20
_storages: dict[str, Storage] = {}
_storages_lock = threading.Lock()


@dataclass(frozen=True)
class Job:
    """What every task needs, shipped to each: where to write, the plan and the tokenizer."""

    out: str
    storage_options: dict
    plan: Plan
    plan_sha256: str
    tokenizer_json: str


@dataclass(frozen=True)
class UnitResult:
    """A task's answer: the shard's counts and checksums, or `error` (`error_kind` "usage":
    a bad record, or an input its reader could not read, the user's to fix; "storage": the output
    failed; "task": the executor's, a task whose worker kept dying, execute.task_failure)."""

    index: int
    n_tokens: int = 0
    n_documents: int = 0
    tokens_sha256: str = ""
    docs_sha256: str = ""
    reused: bool = False
    error: str = ""
    error_kind: str = ""

    def entry(self) -> ShardEntry:
        return ShardEntry(name=shard_name(self.index), n_tokens=self.n_tokens, n_documents=self.n_documents,
                          tokens_sha256=self.tokens_sha256, docs_sha256=self.docs_sha256)

    def as_row(self) -> dict:
        return asdict(self)

    @classmethod
    def from_row(cls, row: dict) -> UnitResult:
        """From a Ray Data row, whose values may come back as numpy scalars."""
        ints = ("index", "n_tokens", "n_documents")
        strs = ("tokens_sha256", "docs_sha256", "error", "error_kind")
        return cls(**{k: int(row[k]) for k in ints}, **{k: str(row[k]) for k in strs}, reused=bool(row["reused"]))


def _storage(job: Job) -> Storage:
    """The output's Storage, one per process and job: an S3 client costs a session and a
    connection pool to build, which a worker running many units should pay once."""
    key = json.dumps([job.out, job.storage_options], sort_keys=True, default=str)
    with _storages_lock:
        if key not in _storages:
            _storages[key] = Storage(job.out, options_for(job.out, job.storage_options))
        return _storages[key]


def run_unit(job: Job, index: int) -> UnitResult:
    storage = _storage(job)
    try:
        found = _reuse(storage, job, index)
        if found is not None:
            return found
        tokens, ends = tokenize_unit(job, job.plan.units[index])
        tokens_bytes, docs_bytes = encode_shard(tokens, ends, job.plan.dtype)
        name = shard_name(index)
        storage.write_immutable(storage.path(name + TOKENS_SUFFIX), tokens_bytes)
        storage.write_immutable(storage.path(name + DOCS_SUFFIX), docs_bytes)
        entry = shard_entry(index, tokens_bytes, docs_bytes, numpy_dtype(job.plan.dtype).itemsize)
        marker = {"plan_sha256": job.plan_sha256, "shard": entry.model_dump()}
        storage.write_immutable(storage.path(name + DONE_SUFFIX), json.dumps(marker).encode())
        return UnitResult(index, entry.n_tokens, entry.n_documents, entry.tokens_sha256, entry.docs_sha256)
    except BadRecord as err:
        return UnitResult(index, error=str(err), error_kind="usage")
    except MemoryError:
        raise  # the worker's size, not the input: retried, then reported as such (execute.task_failure)
    except Exception as err:
        if is_storage_error(err):
            return UnitResult(index, error=f"shard {shard_name(index)}: storage error: {error_reason(err, 300)}",
                              error_kind="storage")
        # Answered, not raised: a raised error would be retried as a dead worker and reported as one.
        # The input's to fix, as a bad record is ("usage": a fresh run's files are withdrawn).
        inputs = sorted({job.plan.sources[p.source].files[p.file].url for p in job.plan.units[index].pieces})
        return UnitResult(index, error=f"shard {shard_name(index)} of {', '.join(inputs[:3])}"
                          f"{' ...' if len(inputs) > 3 else ''}: {error_reason(err, 300)}; fix that input (or leave "
                          "it out) and run the command again", error_kind="usage")


def _reuse(storage: Storage, job: Job, index: int) -> UnitResult | None:
    """The recorded result of a unit a previous run completed, if its files are intact."""
    name = shard_name(index)
    try:
        marker = json.loads(storage.read(storage.path(name + DONE_SUFFIX)))
        if marker.get("plan_sha256") != job.plan_sha256:
            return None
        entry = ShardEntry.model_validate(marker["shard"])
        tokens = storage.read(storage.path(name + TOKENS_SUFFIX))
        docs = storage.read(storage.path(name + DOCS_SUFFIX))
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None  # no marker, a torn one or a missing file: redo the unit
    if entry.name != name or sha256_hex(tokens) != entry.tokens_sha256 or sha256_hex(docs) != entry.docs_sha256:
        return None
    return UnitResult(index, entry.n_tokens, entry.n_documents, entry.tokens_sha256, entry.docs_sha256, reused=True)


def tokenize_unit(job: Job, unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    """The unit's token stream (each document's ids, then EOS) and its documents' end offsets."""
    plan = job.plan
    tokenizer = build_tokenizer(job.tokenizer_json, plan.tokenizer_sha256, plan.parse_special_tokens)
    wide = numpy_dtype(plan.dtype)
    parts, ends, texts, wheres = [], [], [], []
    total = size = 0

    def flush() -> None:
        nonlocal total, size
        if texts:
            flat, lengths = _encode(tokenizer, texts, wheres, plan, wide)
            parts.append(flat)
            ends.append(total + np.cumsum(lengths))
            total += len(flat)
        texts.clear()
        wheres.clear()
        size = 0

    for piece in unit.pieces:
        source = plan.sources[piece.source]
        file = source.files[piece.file]
        for text, where in iter_documents(source, file, piece, plan.text_field, job.storage_options,
                                          plan.skip_empty_texts):
            texts.append(text)
            wheres.append((source.arg, where))
            size += len(text)
            if len(texts) >= BATCH_DOCS or size >= BATCH_BYTES:
                flush()
    flush()
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=wide)
    return tokens, (np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64))


def _encode(tokenizer, texts: list[str], wheres: list[tuple[str, str]], plan: Plan,
            wide: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """One batch: the documents' ids, each followed by EOS (unless it ends with it), and each
    document's length."""
    try:
        # The ids alone: the fast path skips the character offsets (most of the per-token work
        # after the model itself), which a token stream never uses.
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=plan.add_special_tokens)
    except Exception:
        _name_bad_text(texts, wheres)
        raise
    ids = [e.ids for e in encodings]
    # A document that ends with the end token already (a post-processor's, T5's "$A </s>"; or one the
    # text wrote, parsed) is closed: one EOS, whichever flag put it there.
    ends = plan.add_special_tokens or plan.parse_special_tokens
    closed = np.fromiter((ends and bool(x) and x[-1] == plan.eos_id for x in ids), dtype=bool, count=len(ids))
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids)) + ~closed
    flat = np.empty(int(lengths.sum()), dtype=wide)
    appended = np.zeros(len(flat), dtype=bool)
    appended[(np.cumsum(lengths) - 1)[~closed]] = True
    flat[appended] = plan.eos_id
    flat[~appended] = np.fromiter(itertools.chain.from_iterable(ids), dtype=wide, count=len(flat) - int(appended.sum()))
    return flat, lengths


def _name_bad_text(texts: list[str], wheres: list[tuple[str, str]]) -> None:
    """A text the tokenizer refused is one Python can hold but UTF-8 cannot (a lone
    surrogate, e.g. from a JSON "\\ud800" escape): name its record."""
    for text, (arg, where) in zip(texts, wheres, strict=True):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord(f"INPUT {arg}: {where} holds text that is not valid Unicode (a lone surrogate); "
                            "fix or drop that record") from None
