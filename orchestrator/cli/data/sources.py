"""The inputs of `undying data prepare`: what each argument is, checked before anything runs.

Called once by the driver (`prepare.py`) with the INPUT arguments in the order given. Each
becomes a `Source`: its URL (a local path becomes an absolute file:// URL), its kind and its
files, each with a size, a version (ETag or mtime: a changed file changes the plan, so a
resume never mixes two versions of an input) and the sizes of the pieces it can be cut into.

    .txt       one document per file (the whole file, UTF-8); never cut
    .jsonl     one document per non-blank line, the --text-field key of its JSON object; cut
               at any byte (a record belongs to the piece its line starts in)
    .parquet   one document per row, the --text-field column; cut between row groups
    directory  a `datasets` save_to_disk directory: its .arrow files in the order state.json
               lists them, one document per row of the --text-field column; never cut within a file

Every user mistake found here (missing file, unknown extension, missing text field) is a
`UsageError` whose message names the argument and the fix. The text field is checked on the
first record (jsonl) or the schema (parquet, arrow); the tasks check every record.
"""

from __future__ import annotations

import json
import os
from typing import Literal

import fsspec
from pydantic import BaseModel, ConfigDict

from orchestrator.cli.exits import UsageError
from trainer.urls import absolute_url

Kind = Literal["txt", "jsonl", "parquet", "arrow"]
EXTENSIONS: dict[str, Kind] = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
SUPPORTED = ".txt (one document per file), .jsonl (one per line), .parquet (one per row) " \
            "or a directory written by datasets' save_to_disk"


class SourceFile(BaseModel):
    """One file of an input. `atoms` are the byte sizes of the pieces it can be cut between
    (parquet row groups' text column; the whole file for .txt and .arrow); empty for .jsonl,
    which can be cut anywhere."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    size: int
    version: str
    atoms: tuple[int, ...] = ()


class Source(BaseModel):
    """One INPUT argument: as given, resolved, and its files in reading order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arg: str
    url: str
    kind: Kind
    files: tuple[SourceFile, ...]


def to_url(arg: str, flag: str) -> str:
    """An fsspec URL for a command-line location (`flag` names it in an error): URLs stay, paths
    become absolute file:// URLs; an empty one, or a URL mistyped into a path, is a UsageError."""
    try:
        return absolute_url(arg)
    except ValueError as err:
        raise UsageError(f"{flag} {arg!r}: {err}") from None


def options_for(url: str, storage_options: dict) -> dict:
    """`--storage-option`s apply to every non-local location (they configure the object store)."""
    return {} if url.startswith("file://") else storage_options


def open_fs(url: str, storage_options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **options_for(url, storage_options))


def _version(info: dict) -> str:
    for key in ("ETag", "etag", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def describe_file(fs, path: str, url: str, atoms: tuple[int, ...] | None = None) -> SourceFile:
    """The file at `path` as a plan records it (size, version: ETag or modification time)."""
    info = fs.info(path)
    size = int(info.get("size") or 0)
    return SourceFile(url=url, size=size, version=_version(info), atoms=(size,) if atoms is None else atoms)


def resolve_sources(args: list[str], text_field: str, storage_options: dict) -> list[Source]:
    """The checked `Source` of every INPUT argument, in the order given."""
    return [_resolve(arg, text_field, storage_options) for arg in args]


def _resolve(arg: str, text_field: str, storage_options: dict) -> Source:
    url = to_url(arg, "INPUT")
    try:
        fs, path = open_fs(url, storage_options)
        info = fs.info(path)
    except FileNotFoundError:
        raise UsageError(f"INPUT {arg}: no such file or directory; check the path (inputs are {SUPPORTED})") from None
    except (ValueError, ImportError) as err:
        raise UsageError(f"INPUT {arg}: unknown or unavailable protocol ({err}); use a local path, "
                         "file:// or s3:// (with s3fs installed)") from None
    if info.get("type") == "directory":
        return _hf_dataset(arg, url, fs, path, text_field)
    ext = os.path.splitext(path)[1].lower()
    kind = EXTENSIONS.get(ext)
    if kind is None:
        raise UsageError(f"INPUT {arg}: unsupported extension {ext or '(none)'!r}; give {SUPPORTED}")
    if kind == "txt":
        return Source(arg=arg, url=url, kind=kind, files=(describe_file(fs, path, url),))
    if kind == "jsonl":
        if info.get("size") is None:  # (fsspec's HTTP files without a Content-Length)
            raise UsageError(f"INPUT {arg}: the store reports no size for it, and a jsonl file is cut into pieces by "
                             "byte range; copy it to a local directory or to s3:// and give that")
        _check_jsonl_field(arg, fs, path, text_field)
        return Source(arg=arg, url=url, kind=kind, files=(describe_file(fs, path, url, atoms=()),))
    atoms = _parquet_atoms(arg, fs, path, text_field)
    return Source(arg=arg, url=url, kind=kind, files=(describe_file(fs, path, url, atoms),))


def _check_jsonl_field(arg: str, fs, path: str, text_field: str) -> None:
    with fs.open(path, "rb") as f:
        at = 0
        for line in f:
            if line.strip():
                break
            at += len(line)
        else:
            return  # no record at all: an empty input, zero documents
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"INPUT {arg}: the line at byte {at} is not valid UTF-8; convert the file to UTF-8") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"INPUT {arg}: the line at byte {at} is not valid JSON ({err.msg}); "
                         "give JSON Lines, one object per line") from None
    if not isinstance(record, dict):
        raise UsageError(f"INPUT {arg}: the line at byte {at} is a JSON {type(record).__name__}, not an object; "
                         "give JSON Lines, one object per line")
    if text_field not in record:
        raise UsageError(missing_field(arg, text_field, list(record), "the first record"))


def missing_field(arg: str, text_field: str, fields: list[str], where: str) -> str:
    """The message for an input whose records lack --text-field, with the fields they have."""
    have = ", ".join(repr(f) for f in fields[:10]) or "no fields"
    return f"--text-field {text_field}: {where} of {arg} has no field {text_field!r} (it has {have}); " \
           "pass --text-field with the name of the text field"


def _check_schema(arg: str, schema, text_field: str, where: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise UsageError(missing_field(arg, text_field, list(schema.names), where))
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UsageError(f"--text-field {text_field}: column {text_field!r} of {arg} holds {kind}, not strings; "
                         "pass --text-field with the name of the text column")


def _parquet_atoms(arg: str, fs, path: str, text_field: str) -> tuple[int, ...]:
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
    except Exception as err:  # pyarrow's ArrowInvalid and friends: not a parquet file
        if isinstance(err, OSError) and not type(err).__module__.startswith("pyarrow"):
            raise
        raise UsageError(f"INPUT {arg}: not a readable parquet file ({err}); check the file") from None
    _check_schema(arg, schema, text_field, "the schema")
    column = schema.get_field_index(text_field)
    return tuple(meta.row_group(i).column(column).total_uncompressed_size for i in range(meta.num_row_groups))


def _hf_dataset(arg: str, url: str, fs, path: str, text_field: str) -> Source:
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if "state.json" not in names:
        if "dataset_dict.json" in names:
            splits = sorted(n for n in names if n != "dataset_dict.json")
            raise UsageError(f"INPUT {arg}: a DatasetDict; give one split's directory, e.g. {arg.rstrip('/')}/"
                             f"{splits[0] if splits else 'train'}")
        raise UsageError(f"INPUT {arg}: a directory without state.json; give {SUPPORTED}")
    try:
        state = json.loads(fs.cat_file(f"{path}/state.json"))
        files = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise UsageError(f"INPUT {arg}: state.json does not list the data files ({err!r}); "
                         "save the dataset again with save_to_disk") from None
    if not files:
        raise UsageError(f"INPUT {arg}: state.json lists no data files; save the dataset again with save_to_disk")
    found = [describe_file(fs, f"{path}/{name}", f"{url}/{name}") for name in files if name in names]
    if len(found) != len(files):
        missing = next(name for name in files if name not in names)
        raise UsageError(f"INPUT {arg}: {missing}, listed in state.json, is missing; copy the whole directory")
    _check_schema(arg, _arrow_schema(arg, fs, f"{path}/{files[0]}"), text_field, files[0])
    return Source(arg=arg, url=url, kind="arrow", files=tuple(found))


def open_arrow(f):
    """A record-batch reader of an Arrow file: the IPC stream format `datasets` writes, or the
    IPC file format."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(f)
    except pa.ArrowInvalid:
        f.seek(0)
        return pa.ipc.open_file(f)


def _arrow_schema(arg: str, fs, path: str):
    try:
        with fs.open(path, "rb") as f:
            return open_arrow(f).schema
    except Exception as err:
        if isinstance(err, OSError) and not type(err).__module__.startswith("pyarrow"):
            raise
        raise UsageError(f"INPUT {arg}: {path.rsplit('/', 1)[-1]} is not an Arrow file ({err}); "
                         "save the dataset again with save_to_disk") from None
