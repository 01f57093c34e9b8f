"""The YAML every user file is read with (a spec, a storage-options file): duplicate keys refused,
plain scalars as YAML 1.2 reads them, parse errors a person can act on.

Callers: `orchestrator.spec.job_spec.load_spec` and `orchestrator.spec.yaml_input` (a spec and its
`--set` values), `orchestrator.spec.secrets.read_options_file` (a section's storage_options_file);
one loader, so a value means the same in the spec and in the file beside it.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"


class UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # The keys written here; a merge (`<<: *defaults`) is not one, and the keys it brings may be
        # overridden by written ones, as YAML means (the base class merges them).
        written = [key_node for key_node, _ in node.value if key_node.tag != MERGE_TAG]
        keys = [self.construct_object(key_node, deep=deep) for key_node in written]
        for i, key in enumerate(keys):
            if isinstance(key, Hashable) and key in keys[:i]:  # unhashable: the base class reports it
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", written[i].start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False):
        # An explicit tag on text it cannot take (`!!float abc`, `!!bool maybe`, `!!timestamp x`): PyYAML's
        # constructors raise ValueError, KeyError or AttributeError, which every caller would show as a
        # traceback; as a ConstructorError it is a YAML error at its line, worded like the others.
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.tag.rsplit(':', 1)[-1]} tag on {node.value!r}, which is not one",
                node.start_mark) from None


# PyYAML implements YAML 1.1, which reads some plain scalars otherwise than YAML 1.2 (and JSON,
# and what a person means): `steps: 010` is octal 8, `1:30` is 90, `2024-06-01` a date, `off` and
# `no` false, while `1e3` is a string ("not a number"). This loader reads them as YAML 1.2's core
# schema does: integers decimal (`0o10` octal, `0x1f` hex; a sign and `_` between digits, as PyYAML
# took them, still allowed), floats with an exponent too, booleans only true/false, no timestamps
# (the text stays text: a name or a URL). Changed on the subclass only.
_INT, _BOOL, _TIMESTAMP = "tag:yaml.org,2002:int", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp"
UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _BOOL, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
UniqueKeyLoader.add_implicit_resolver(
    _INT, re.compile(r"^[-+]?(?:[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*)$"), list("-+0123456789"))
UniqueKeyLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    digits = text.replace("_", "")
    sign, digits = (-1, digits[1:]) if digits[:1] == "-" else (1, digits.removeprefix("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
    try:
        return sign * int(digits[2:] if base != 10 else digits, base)
    except ValueError:  # an explicit `!!int` tag on text that is not one
        raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer", node.start_mark) from None


UniqueKeyLoader.add_constructor(_INT, _yaml_12_int)


def yaml_reason(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return at + " ".join(str(getattr(error, "problem", None) or error).split())
