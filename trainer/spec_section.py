"""The base of every section of a job spec: strict about what a user writes.

A key the section does not have is refused (a typo silently ignored is a wasted GPU-day, a fault
never injected, a limit never applied). A section is frozen: the validated spec is shared by the
controller and every rank and must not drift. And a yes/no is not a number: YAML reads `true` as
a boolean, which pydantic would take as the integer 1 (`train.steps: true` would train one step,
`parallel.dp: true` run one rank). Nor are YAML's `.inf` and `.nan`.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _kinds(annotation) -> set:
    """The plain types an annotation admits (through unions, Optional, Annotated and Literal)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # the type, not its metadata
        return _kinds(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(value) for value in typing.get_args(annotation)}
    return {origin or annotation}


def takes_a_number_not_a_yes_no(annotation) -> bool:
    kinds = _kinds(annotation)
    return bool(kinds & {int, float}) and not kinds & {bool, Any, object}


class SpecSection(BaseModel):
    # allow_inf_nan: YAML's .inf and .nan are floats too, and no field means "forever" by infinity.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _a_yes_no_is_not_a_number(cls, value, info: ValidationInfo):
        if isinstance(value, bool) and takes_a_number_not_a_yes_no(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a yes/no, not a number; write a number")
        return value
