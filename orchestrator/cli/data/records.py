"""Reading the documents of one piece of an input, in file order, inside a preparation task.

Called by `shard_task.run_unit` for each piece of its unit, in order. `iter_documents`
yields `(text, where)`: the document's text and where it is (e.g. "the line at byte 812"),
which a later error names. A piece of a .jsonl file is a byte range [start, stop): it holds
the records whose lines start in it, so consecutive pieces hold every line exactly once
whatever the cut points (the line that straddles a cut belongs to the piece it starts in).
A piece of a .parquet file is a row-group range; a .txt or .arrow piece is the whole file.

An empty text (a file, a record, a row) is no document: it is skipped, not made one of EOS alone.
A record that cannot be a document (not UTF-8, not JSON, no text field, not a string)
raises `BadRecord`, whose message names the input and the fix.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from orchestrator.cli.data.sources import Source, SourceFile, describe_file, missing_field, open_arrow, open_fs
from orchestrator.cli.data.units import Piece
from orchestrator.cli.exits import UsageError


class BadRecord(UsageError):
    """A record of an input cannot be read as a document; the message names it and the fix."""


def iter_documents(source: Source, file: SourceFile, piece: Piece, text_field: str,
                   storage_options: dict, skip_empty: bool = True) -> Iterator[tuple[str, str]]:
    """`skip_empty`: the plan's rule (plan.Plan.skip_empty_texts); without it, as plans written
    before it had it, only an empty .txt file is no document."""
    fs, path = open_fs(file.url, storage_options)
    _unchanged(source, file, fs, path)
    # An empty text (a file, a record, a row: a dataset's blank lines) is no document, not one of EOS alone.
    yield from ((text, where) for text, where in _documents(source, fs, path, piece, text_field)
                if text or not (skip_empty or source.kind == "txt"))
    _unchanged(source, file, fs, path)  # and not while it was read


def _documents(source: Source, fs, path: str, piece: Piece, text_field: str) -> Iterator[tuple[str, str]]:
    if source.kind == "txt":
        yield _txt(source, fs.cat_file(path)), "the file"
    elif source.kind == "jsonl":
        with fs.open(path, "rb") as f:
            yield from _jsonl(source, f, piece.start, piece.stop, text_field)
    elif source.kind == "parquet":
        yield from _parquet(source, fs, path, piece, text_field)
    else:
        yield from _arrow(source, fs, path, text_field)


def _unchanged(source: Source, file: SourceFile, fs, path: str) -> None:
    """BadRecord when the file is not the one planned (its size or version differ): the plan's cuts
    are of that one, and a dataset of two versions of an input would duplicate or drop documents."""
    now = describe_file(fs, path, file.url)
    if (now.size, now.version) != (file.size, file.version):
        raise BadRecord(f"INPUT {source.arg}: {file.url} changed while it was being prepared (size {file.size} -> "
                        f"{now.size}, or another version); prepare it again once it no longer changes")


def _txt(source: Source, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRecord(f"INPUT {source.arg}: not valid UTF-8 at byte {err.start}; "
                        "convert it to UTF-8 (e.g. `iconv -t UTF-8`)") from None


def _jsonl(source: Source, f, start: int, stop: int, text_field: str) -> Iterator[tuple[str, str]]:
    pos = start
    if start > 0:
        # The line that holds byte start-1 began in the previous piece (or ends exactly
        # there): skip past it, so this piece starts at the first line that starts in it.
        f.seek(start - 1)
        pos = start - 1 + len(f.readline())
    while pos < stop:
        line = f.readline()
        if not line:
            return
        at, pos = pos, pos + len(line)
        if line.strip():
            yield _json_text(source, line, at, text_field), f"the line at byte {at}"


def _json_text(source: Source, line: bytes, at: int, text_field: str) -> str:
    where = f"the line at byte {at}"
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise BadRecord(f"INPUT {source.arg}: {where} is not valid UTF-8 (at its byte {err.start}); "
                        "fix or remove that line (the text must be UTF-8)") from None
    except json.JSONDecodeError as err:
        raise BadRecord(f"INPUT {source.arg}: {where} is not valid JSON ({err.msg}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise BadRecord(f"INPUT {source.arg}: {where} is a JSON {type(record).__name__}, not an object; "
                        "give JSON Lines, one object per line")
    if text_field not in record:
        raise BadRecord(missing_field(source.arg, text_field, list(record), where))
    return _text(source, record[text_field], where, text_field)


def _text(source: Source, value, where: str, text_field: str) -> str:
    if value is None:
        raise BadRecord(f"INPUT {source.arg}: {where} has no text (null in {text_field!r}); drop or fill such records")
    if not isinstance(value, str):
        raise BadRecord(f"INPUT {source.arg}: {where} has {type(value).__name__} in {text_field!r}, not a string; "
                        "fix or drop that record")
    return value


def _parquet(source: Source, fs, path: str, piece: Piece, text_field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        row = sum(parquet.metadata.row_group(i).num_rows for i in range(piece.start))
        for group in range(piece.start, piece.stop):
            with _readable(source, f"row group {group} (from row {row})"):
                values = parquet.read_row_group(group, columns=[text_field]).column(text_field).to_pylist()
            for value in values:
                yield _text(source, value, f"row {row}", text_field), f"row {row}"
                row += 1


def _arrow(source: Source, fs, path: str, text_field: str) -> Iterator[tuple[str, str]]:
    name = path.rsplit("/", 1)[-1]
    row = 0
    with fs.open(path, "rb") as f:
        reader = open_arrow(f)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) \
            if hasattr(reader, "get_batch") else reader
        for batch in batches:
            with _readable(source, f"the record batch from row {row} of {name}"):
                values = batch.column(text_field).to_pylist()
            for value in values:
                where = f"row {row} of {name}"
                yield _text(source, value, where, text_field), where
                row += 1


@contextlib.contextmanager
def _readable(source: Source, where: str) -> Iterator[None]:
    """What pyarrow refuses in a part of a columnar input, as a BadRecord naming the part and the fix:
    text that is not UTF-8, or a damaged file (pyarrow's own errors). Storage errors pass as they come
    (a task retries those)."""
    try:
        yield
    except UnicodeDecodeError as err:
        byte = err.object[err.start]
        raise BadRecord(f"INPUT {source.arg}: {where} holds text that is not valid UTF-8 (byte {byte:#04x}); "
                        "convert those records to UTF-8 or drop them") from None
    except Exception as err:
        if not type(err).__module__.startswith("pyarrow"):
            raise
        raise BadRecord(f"INPUT {source.arg}: {where} cannot be read ({' '.join(str(err).split())[:200]}); the "
                        "file is damaged: write it again") from None
