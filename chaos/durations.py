"""Durations in the `chaos:` section: seconds as a number, or a string such as "30s", "2m", "1.5h".

Used through the `Seconds` annotated type by chaos.config; a bad string is reported with
the accepted forms, so the user sees how to write it.
"""

from __future__ import annotations

import math
import re
from typing import Annotated

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


# The JSON Schema (`undying spec --schema`) admits the string forms too, so editors accept "30s".
_SCHEMA = {"anyOf": [{"type": "number", "minimum": 0},
                     {"type": "string", "pattern": r"^\s*(\d+(\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$"}]}
Seconds = Annotated[float, BeforeValidator(parse_duration), WithJsonSchema(_SCHEMA)]
