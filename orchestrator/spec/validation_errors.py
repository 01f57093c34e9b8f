"""How a pydantic `ValidationError` on the job spec reads to its user: one `Problem` per error,
each naming the dotted field and saying what to write instead.

Protocol: `orchestrator.spec.job_spec.validate_spec` catches the error pydantic raises while it
validates the whole spec and calls `problems_from_validation_error(error, JobSpec)`; the spec's
model is a parameter (not imported) so the wording depends only on pydantic's error records.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from orchestrator.spec.problems import Problem
from orchestrator.spec.secrets import FILE_KEY, STORAGE_SECTIONS
from orchestrator.spec.yaml_input import show

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def _dotted(loc: Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        # A key that is not a plain name is quoted, so the field stays one readable line.
        key = str(part) if _PLAIN_KEY.fullmatch(str(part)) else show(part)
        text += f"[{part}]" if isinstance(part, int) else (f".{key}" if text else key)
    return text or "spec"


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `X`, `X | None` or `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(model_in, get_args(annotation)) if m is not None), None)


def keys_of(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _section(root: type[BaseModel], loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model that validates the mapping at `loc` (list indices are transparent)."""
    model: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        info = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        model = model_in(info.annotation) if info else None
    return model


def _empty(root: type[BaseModel], loc: Sequence[str | int]) -> str:
    """An empty section: the defaults it takes when left out, or (required, or a list's item) what to give."""
    parent = _section(root, loc[:-1])
    info = next((f for n, f in parent.model_fields.items() if loc[-1] in (n, f.alias)), None) \
        if parent is not None and isinstance(loc[-1], str) else None
    if info is not None and not info.is_required():
        return "is empty; give the section's keys, or remove it to take the defaults"
    section = _section(root, loc)
    needed = [info.alias or name for name, info in section.model_fields.items() if info.is_required()] \
        if section is not None else []
    return "is empty; it is required: give " + (", ".join(needed) if needed else "its keys")


def _unknown_key(root: type[BaseModel], loc: Sequence[str | int]) -> str:
    key, section = loc[-1], _section(root, loc[:-1])
    if section is None:
        return f"unknown key {key!r}; remove it"
    allowed = keys_of(section)
    if len(loc) == 2 and loc[0] in STORAGE_SECTIONS:
        allowed.append(FILE_KEY)  # read (and removed) before validation: orchestrator.spec.secrets
    close = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; allowed keys: {', '.join(allowed)}"


def _describe(root: type[BaseModel], error: Mapping[str, Any]) -> str:
    kind, loc, msg = error["type"], error["loc"], error["msg"]
    if kind == "extra_forbidden":
        return _unknown_key(root, loc)
    if kind == "missing" and isinstance(loc[-1], int):  # a fixed-length list given too few items
        return _short_list(root, loc)
    if kind == "missing":
        where = _dotted(loc[:-1]) if len(loc) > 1 else "the top level"
        return f"required key {loc[-1]!r} is missing; add it under {where}"
    if kind in ("spec", "value_error"):  # our own messages, already saying what to do
        return msg.removeprefix("Value error, ")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if error["input"] is None:
            return _empty(root, loc)
        section = _section(root, loc)
        if isinstance(error["input"], bool) and section is not None and "enabled" in section.model_fields:
            return f"expected a mapping of keys (a YAML section), got {show(error['input'])}; write " \
                   f"{{enabled: {str(error['input']).lower()}}}"
        return f"expected a mapping of keys (a YAML section), got {show(error['input'])}"
    return f"{msg.replace('Input should be', 'should be')}; got {show(error['input'])}{_hint(error)}"


def _short_list(root: type[BaseModel], loc: Sequence[str | int]) -> str:
    section = _section(root, loc[:-2])
    info = section.model_fields.get(str(loc[-2])) if section is not None else None
    what = f": {info.description}" if info is not None and info.description else ""
    return f"the list ends before item {loc[-1]} (items count from 0); give all its items{what}"


def _hint(error: Mapping[str, Any]) -> str:
    """The fix for a type error YAML makes easy: a scalar read as a number or a boolean where text
    was meant, a duration written with its unit where seconds are a number."""
    value, name = error["input"], str(error["loc"][-1]) if error["loc"] else ""
    if error["type"] == "string_type" and isinstance(value, bool | int | float | dict):
        also = " (YAML reads true and false as booleans)" if isinstance(value, bool) else \
            " (YAML reads 'key: value' as a mapping)" if isinstance(value, dict) else ""
        return f"; quote it to give text{also}"
    if error["type"] in ("float_parsing", "int_parsing") and (name.endswith("_s") or "seconds" in name):
        return "; give seconds as a number, e.g. 600 for 10 minutes"
    return ""


def problems_from_validation_error(error: ValidationError, root: type[BaseModel]) -> list[Problem]:
    """Translate a ValidationError raised while validating `root` (the whole spec) into Problems."""
    return [Problem(_dotted(e["loc"]), " ".join(_describe(root, e).split())) for e in error.errors()]
