"""Durations in the `chaos:` section: seconds as a number, or a string such as "30s", "2m", "1.5h".

Used through the `Seconds` and `PositiveSeconds` annotated types by chaos.config; a bad string is reported with
the accepted forms, so the user sees how to write it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

from annotated_types import Ge, Gt
from pydantic import BeforeValidator, WithJsonSchema

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
FORMS = "a number of seconds or a string like '30s', '2m', '1.5h', '1d'"


def parse_duration(value: object) -> object:
    """Seconds as a float for a duration string; anything else is passed on for pydantic to check.

    Numbers pass through unchanged (pydantic then checks type and bounds), so only the
    string forms are handled here. A string without a unit means seconds.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        return value
    match = _DURATION.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a duration; write {FORMS}")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is too large a duration; write {FORMS}")
    return seconds


def _schema(bound: dict) -> WithJsonSchema:
    """The JSON Schema (`undying spec --schema`) admits the string forms too, so editors accept "30s".
    The bound is part of the type: pydantic cannot translate a Field's gt/ge into a replaced
    schema, and would copy it there as a "gt" key that JSON Schema does not know."""
    return WithJsonSchema({"anyOf": [{"type": "number", **bound},
                                     {"type": "string", "pattern": r"^\s*(\d+(\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$"}]})


# Seconds, zero or more; PositiveSeconds, more than zero. Give the bound here, never in Field.
Seconds = Annotated[float, BeforeValidator(parse_duration), Ge(0), _schema({"minimum": 0})]
PositiveSeconds = Annotated[float, BeforeValidator(parse_duration), Gt(0), _schema({"exclusiveMinimum": 0})]
