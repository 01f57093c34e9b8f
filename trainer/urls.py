"""URLs of checkpoints and datasets, as every process of a job must read them, and how a store may
answer a ranged read of one wrongly (RangeIgnored).

A plain path becomes an absolute `file://` URL at spec load, in the driver: ranks and the
controller run elsewhere, in other working directories, so a relative path would name another
folder on each (or none). A URL mistyped into a relative path is refused for the same reason.
Called by the spec's validators (ckpt.config, trainer.config) and the CLI's URL arguments.
"""

from __future__ import annotations

import os
import re

# fsspec protocols of object stores, whose locations start with a bucket (or container).
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
_ONE_SLASH = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):/(?!/)")
_NO_SLASH = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):(?!/)")
# Schemes a URL without its slashes (`s3:bucket/x`) is taken for; another name with a colon is a path.
_KNOWN_SCHEMES = OBJECT_STORES | {"file", "memory", "http", "https", "hf"}


def absolute_url(url: str) -> str:
    """An fsspec URL with an absolute path and no trailing slash; ValueError when empty, or when it
    is a URL mistyped into a relative path (`file:/data`, `s3:/bucket`, `s3:bucket`, `file://data`):
    taken as written, it would name a folder under the working directory."""
    url = url.strip()
    if not url:
        raise ValueError("is empty; give an fsspec URL such as file:///data/ckpt or s3://bucket/prefix")
    if one_slash := _ONE_SLASH.match(url):
        scheme, rest = one_slash.group(1), url[one_slash.end():]
        if len(scheme) == 1:  # a drive letter: the processes of a job run on Linux
            raise ValueError(f"{url!r} is a Windows path; give a path or URL of the machines the job runs on")
        meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
        raise ValueError(f"{url!r} has one slash after '{scheme}:'; did you mean {meant!r}?")
    if (bare := _NO_SLASH.match(url)) and bare.group(1).lower() in _KNOWN_SCHEMES:
        scheme, rest = bare.group(1), url[bare.end():]
        meant = f"file:///{rest}" if scheme.lower() == "file" else f"{scheme}://{rest}"
        raise ValueError(f"{url!r} has no slashes after '{scheme}:' (taken as written, it would be a folder "
                         f"named so under the working directory); did you mean {meant!r}?")
    if url.startswith("file://") and not url.startswith("file:///"):
        raise ValueError(f"{url!r}: file:// takes an absolute path (file:///data/ckpt, three slashes); for a "
                         "folder under the working directory give the plain path")
    if "://" not in url:
        # A plain path: make it absolute now, so every rank and the controller agree on it
        # whatever their working directory.
        url = "file://" + os.path.abspath(os.path.expanduser(url))
    protocol, _, path = url.partition("://")
    if protocol != "file" and not path.strip("/"):
        raise ValueError(f"{url!r} names no location; write one after '{protocol}://'"
                         + (f", e.g. {protocol}://bucket/prefix" if protocol in OBJECT_STORES else ""))
    # A trailing slash would give "a//job" when the job name is appended; a bare root
    # ("file:///") keeps its slash because there is nothing else left of the path.
    return f"{protocol}://{path.rstrip('/') or '/'}"


def place_of(url: str) -> str:
    """One spelling per place, to tell whether two URLs name the same files: s3a:// is s3://, and a local
    path its real one (symlinks resolved); no trailing slash."""
    url = url.rstrip("/")
    if url.startswith("s3a://"):
        return "s3://" + url.removeprefix("s3a://")
    return "file://" + os.path.realpath(url.removeprefix("file://")) if url.startswith("file://") else url


class RangeIgnored(RuntimeError):
    """A store sent more than the byte range asked, as one that ignores HTTP Range requests does (a
    server or a proxy): the bytes are not the range, yet prove no damage, and every read would do
    the same (not transient). Raised by the ranged readers (ckpt.storage, trainer.tokens.reader)."""


def range_ignored(path: str, got: int, asked: int, start: int) -> RangeIgnored:
    return RangeIgnored(f"{path}: the store answered {got} bytes for the {asked}-byte range at {start}: it ignores "
                        "HTTP Range requests, and undying reads checkpoints and datasets by byte ranges; use a store "
                        "(or a proxy setting) that honours them")
