"""Reading a spec from users: the YAML file (orchestrator.spec.yaml_loader), `--set` overrides.

`apply_overrides` is called by `orchestrator.spec.job_spec.load_spec` on the parsed YAML before
validation; every malformed override is reported, naming itself. An override's key is a dotted
path whose parts are bare (`parallel.dp`, `chaos.faults.0.rank`) or quoted with '...' or "..."
when they hold other characters (`checkpoint.storage_options."client_kwargs:x"=1`), the
spelling spec errors use for such keys.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from orchestrator.spec.problems import Problem, SpecError
from orchestrator.spec.secrets import FIX, command_line_credentials
from orchestrator.spec.yaml_loader import UniqueKeyLoader, yaml_reason

_BARE_PART = re.compile(r"[A-Za-z0-9_-]+")
_KEY_SYNTAX = ("write key.path=value, e.g. --set parallel.dp=4; quote a key part that holds other characters "
               "than letters, digits, '_' and '-': --set 'checkpoint.storage_options.\"client_kwargs:x\"=1'")


def split_override(text: str) -> tuple[list[str], str]:
    """`a.b."c:d"=v` -> (["a", "b", "c:d"], "v"): the key path's parts and the raw value text.

    A part is bare (letters, digits, `_`, `-`) or quoted with '...' or "..." (any characters but
    that quote, `.` and `=` included); parts are separated by `.`, and the key ends at the first
    `=` outside quotes. Raises SpecError naming the override."""
    parts, i, stripped = [], 0, text.strip()
    while True:
        quote = stripped[i:i + 1]
        if quote in ("'", '"'):
            end = stripped.find(quote, i + 1)
            if end < 0:
                raise SpecError([Problem("--set", f"{text!r}: the quote {quote} opened at {stripped[i:]!r} is "
                                         f"never closed; {_KEY_SYNTAX}")])
            parts.append(stripped[i + 1:end])
            i = end + 1
        else:
            bare = _BARE_PART.match(stripped, i)
            if bare is None:
                raise SpecError([Problem("--set", f"{text!r} is not key.path=value; {_KEY_SYNTAX}")])
            parts.append(bare.group(0))
            i = bare.end()
        if stripped[i:].lstrip().startswith("="):
            return parts, stripped[i:].lstrip()[1:]
        if stripped[i:i + 1] == "[":
            raise SpecError([Problem("--set", f"{text!r}: a list item is a key part of its own: write "
                                     f"{stripped[:i]}.0 for item 0, not {stripped[:i]}[0]")])
        if stripped[i:i + 1] != ".":
            raise SpecError([Problem("--set", f"{text!r} is not key.path=value; {_KEY_SYNTAX}")])
        i += 1


def _parse_override(text: str) -> tuple[list[str], Any]:
    path, raw = split_override(text)
    key = dotted_key(path)
    if not raw.strip():
        raise SpecError([Problem(key, f"--set {text!r} has no value; write {key}=null to clear it")])
    try:
        return path, yaml.load(raw, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise SpecError([Problem(key, f"--set {text!r}: the value is not valid YAML ({yaml_reason(error)}); "
                                 "quote it, e.g. --set 'name=\"a: b\"'")]) from None


def dotted_key(path: Sequence[str]) -> str:
    """The override key that addresses `path`: bare parts as they are, the others quoted."""
    return ".".join(p if _BARE_PART.fullmatch(p) else show(p) for p in path)


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(path):
        last, here = depth == len(path) - 1, ".".join(path[: depth + 1])
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ValueError(f"{'.'.join(path[:depth])} is a list of {len(node)}; {part!r} is not an index "
                                 f"in it: {f'use 0..{len(node) - 1}, or ' if node else ''}set the whole list, e.g. "
                                 f"--set '{'.'.join(path[:depth])}=[{{...}}]'")
            index: Any = int(part)
        elif isinstance(node, dict):
            index = part
            if not last and node.get(part) is None:
                if path[depth + 1].isdigit():  # an item of a list the spec does not have
                    raise ValueError(f"{here} is not in the spec, so it has no item {path[depth + 1]}: set the "
                                     f"whole list, e.g. --set '{here}=[{{...}}]'")
                node[part] = {}  # a section missing from the YAML, or written as an empty key
        else:
            raise ValueError(f"{'.'.join(path[:depth])} is {show(node)}, not a section; "
                             f"cannot set {here} inside it")
        if last:
            node[index] = value
        else:
            # A copy of the section on the way down: a YAML alias (`storage_options: *s3`) shares it
            # with another place, which this override must leave as written.
            node[index] = copy.copy(node[index])
            node = node[index]


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `key.path=value` override applied in order. Values are
    parsed as YAML (`4` is an int, `[]` a list, `s3://b/p` a string); list items are
    addressed by index (`chaos.faults.0.rank=2`). Raises SpecError naming every bad one, and
    every override that would put a credential into storage options (orchestrator.spec.secrets)."""
    result, problems = copy.deepcopy(dict(data)), []
    for text in overrides:
        path: list = []
        try:
            path, value = _parse_override(text)
            secret = command_line_credentials(path, value)
            if secret:
                problems.append(Problem("--set", f"{secret[0]}: refused, a credential on the command line "
                                        f"({FIX}, named by {path[0]}.storage_options_file)"))
                continue
            _set_path(result, path, value)
        except SpecError as error:
            problems += error.problems
        except ValueError as error:
            problems.append(Problem(dotted_key(path) if path else "--set", f"--set {text!r}: {error}"))
    if problems:
        raise SpecError(problems)
    return result



def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
