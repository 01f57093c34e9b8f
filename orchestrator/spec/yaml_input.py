"""Reading YAML from users: duplicate keys refused, readable parse errors, `--set` overrides.

`apply_overrides` is called by `orchestrator.spec.job_spec.load_spec` on the parsed YAML before
validation; every malformed override is reported, naming itself.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import yaml

from orchestrator.spec.problems import Problem, SpecError
from orchestrator.spec.secrets import FIX, command_line_credentials


class UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(key_node, deep=deep) for key_node, _ in node.value]
        for i, key in enumerate(keys):
            if isinstance(key, Hashable) and key in keys[:i]:  # unhashable: the base class reports it
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", node.value[i][0].start_mark)
        return super().construct_mapping(node, deep=deep)


def yaml_reason(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return at + " ".join(str(getattr(error, "problem", None) or error).split())


_OVERRIDE_KEY = re.compile(r"[A-Za-z_]\w*(\.(\w+))*")


def _parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _OVERRIDE_KEY.fullmatch(key):
        raise SpecError([Problem("--set", f"{text!r} is not key.path=value; write e.g. --set parallel.dp=4")])
    if not raw.strip():
        raise SpecError([Problem(key, f"--set {text!r} has no value; write {key}=null to clear it")])
    try:
        return key.split("."), yaml.load(raw, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise SpecError([Problem(key, f"--set {text!r}: the value is not valid YAML ({yaml_reason(error)}); "
                                 "quote it, e.g. --set 'name=\"a: b\"'")]) from None


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(path):
        last, here = depth == len(path) - 1, ".".join(path[: depth + 1])
        if isinstance(node, list):
            if not (part.isdigit() and int(part) < len(node)):
                raise ValueError(f"{'.'.join(path[:depth])} is a list of {len(node)}; "
                                 f"{part!r} is not an index in it")
            index: Any = int(part)
        elif isinstance(node, dict):
            index = part
            if not last and node.get(part) is None:
                node[part] = {}  # a section missing from the YAML, or written as an empty key
        else:
            raise ValueError(f"{'.'.join(path[:depth])} is {show(node)}, not a section; "
                             f"cannot set {here} inside it")
        if last:
            node[index] = value
        else:
            node = node[index]


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each `key.path=value` override applied in order. Values are
    parsed as YAML (`4` is an int, `[]` a list, `s3://b/p` a string); list items are
    addressed by index (`chaos.faults.0.rank=2`). Raises SpecError naming every bad one, and
    every override that would put a credential into storage options (orchestrator.spec.secrets)."""
    result, problems = copy.deepcopy(dict(data)), []
    for text in overrides:
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
            problems.append(Problem(text.partition("=")[0].strip(), f"--set {text!r}: {error}"))
    if problems:
        raise SpecError(problems)
    return result



def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
