"""The job spec's reference, generated from its pydantic models: JSON Schema and docs/spec.md.

Protocol: `undying spec --schema` prints `json_schema()`; `undying spec --markdown` prints
`markdown()`, which is what docs/spec.md holds (tests/unit/test_spec_reference.py regenerates it
and fails when the file differs, so the reference cannot drift from the code). Every field is
listed by its dotted YAML path (aliases as YAML spells them: `checkpoint.async`), with its type,
default, constraints and description; a field whose type is a section is described by the
section's docstring. `undocumented()` lists the fields that have neither.
"""

from __future__ import annotations

import inspect
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, WithJsonSchema
from pydantic.fields import FieldInfo

from orchestrator.spec.job_spec import JobSpec
from orchestrator.spec.secrets import FILE_KEY, STORAGE_SECTIONS

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
REGENERATE = "undying spec --markdown > docs/spec.md"
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "mapping", Any: "any"}
# Read and removed before validation (orchestrator.spec.secrets), so no model has it: the
# reference and the schema add it to each section that takes it.
FILE_DESCRIPTION = ("path of a YAML or JSON file of storage options (credentials, endpoint), relative to the "
                    "spec's directory; read into storage_options when the spec is loaded, so the secrets stay "
                    "out of the spec. A key may not be set both here and in storage_options")
_BOUNDS = ((at.Gt, "gt", "> {}"), (at.Ge, "ge", ">= {}"), (at.Lt, "lt", "< {}"), (at.Le, "le", "<= {}"),
           (at.MultipleOf, "multiple_of", "multiple of {}"), (at.MinLen, "min_length", "length >= {}"),
           (at.MaxLen, "max_length", "length <= {}"))


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a job spec, keys as YAML spells them, for editors
    (e.g. `# yaml-language-server: $schema=spec.schema.json` at the top of a job YAML)."""
    schema = JobSpec.model_json_schema(by_alias=True, mode="validation")
    for section in STORAGE_SECTIONS:
        model = section_model(JobSpec.model_fields[section].annotation)
        schema["$defs"][model.__name__]["properties"][FILE_KEY] = {
            "type": "string", "minLength": 1, "title": "Storage Options File", "description": FILE_DESCRIPTION}
    return {"$schema": SCHEMA_DIALECT, **schema}


@dataclass(frozen=True)
class FieldRow:
    """One field of the reference: where it is and what it takes."""

    path: str  # dotted YAML path; `[]` marks the items of a list
    type: str
    default: str
    constraints: str
    description: str


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `X`, `X | None` or `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(section_model, get_args(annotation)) if m is not None), None)


def type_text(annotation: Any) -> str:
    """A reader's spelling of a field's type: `integer or null`, `"young" or number`, `list of section`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Annotated:
        return type_text(args[0]) + (" or string" if any(_takes_strings(m) for m in args[1:]) else "")
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}" if args else "mapping"
    if section_model(annotation) is not None:
        return "section"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _takes_strings(extra: Any) -> bool:
    """Whether a schema override (`WithJsonSchema`, `json_schema_extra`) admits strings besides the
    annotated type: durations such as "30s", checkpoint intervals such as "500 steps"."""
    schema = extra.json_schema if isinstance(extra, WithJsonSchema) else extra
    return isinstance(schema, dict) and any(s.get("type") == "string" for s in schema.get("anyOf", ()))


def field_type(info: FieldInfo) -> str:
    """`type_text` of the field's annotation, with the strings its schema override admits."""
    text = type_text(info.annotation)
    extras = [*info.metadata, info.json_schema_extra]
    return text + (" or string" if "string" not in text and any(map(_takes_strings, extras)) else "")


def _constraints(info: FieldInfo) -> str:
    found = []
    for item in info.metadata:
        for kind, attr, text in _BOUNDS:
            if isinstance(item, kind):
                found.append(text.format(getattr(item, attr)))
    # Constraints on a mapping's values (`dict[str, Annotated[float, Field(ge=0)]]`) apply per value;
    # those of an optional bounded type (`PositiveSeconds | None`) to the value itself.
    each = "" if get_origin(info.annotation) in (Union, types.UnionType) else "each "
    for arg in get_args(info.annotation):
        if get_origin(arg) is Annotated:
            inner = FieldInfo.from_annotation(arg)
            found += [f"{each}{c}" for c in _constraints(inner).split(", ") if c]
    return ", ".join(found)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its section's defaults"
    return json.dumps(value, default=str)


def description(info: FieldInfo) -> str:
    """The field's own description, else (for a section) its model's docstring, first paragraph."""
    if info.description:
        return " ".join(info.description.split())
    model = section_model(info.annotation)
    doc = inspect.cleandoc(model.__doc__ or "") if model and model.__doc__ else ""
    return " ".join(doc.split("\n\n")[0].split())


def rows(model: type[BaseModel] = JobSpec, prefix: str = "") -> Iterator[tuple[str, FieldRow]]:
    """Every field of `model` and of its sections, depth first, as (section path, row)."""
    nested = []
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        yield prefix.rstrip("."), FieldRow(path, field_type(info), _default(info), _constraints(info),
                                           description(info))
        sub = section_model(info.annotation)
        if sub is not None:
            is_list = get_origin(info.annotation) is list or any(get_origin(a) is list
                                                                 for a in get_args(info.annotation))
            nested.append((sub, path + ("[]." if is_list else ".")))
    if prefix.rstrip(".") in STORAGE_SECTIONS:
        yield prefix.rstrip("."), FieldRow(prefix + FILE_KEY, "string", "(none)", "length >= 1",
                                           FILE_DESCRIPTION)
    for sub, sub_prefix in nested:
        yield from rows(sub, sub_prefix)


def undocumented() -> list[str]:
    """Dotted paths of the fields with no description (and, for sections, no docstring)."""
    return [row.path for _, row in rows() if not row.description]


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else " "


def _section_doc(section: str) -> str:
    model: type[BaseModel] | None = JobSpec
    for part in section.replace("[]", "").split("."):
        info = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None) if model else None
        model = section_model(info.annotation) if info else None
    return inspect.cleandoc(model.__doc__) if model and model.__doc__ else ""


def markdown() -> str:
    """docs/spec.md: one table per section, every field with its path, type, default, constraints
    and description."""
    out = ["# Job spec reference", "",
           f"Generated from the pydantic models (orchestrator/spec/reference.py) by `{REGENERATE}`; do not",
           "edit it by hand: a test fails when it differs from what the code generates. `undying spec",
           "--schema` prints the same spec as JSON Schema, for editors. A path with `[]` names the keys of",
           "each item of a list. Durations in `chaos` accept `30s`, `2m`, `1h`.", ""]
    current = None
    for section, row in rows():
        if section != current:
            current = section
            title = f"`{section}`" if section else "Top level"
            doc = _section_doc(section) if section else inspect.cleandoc(JobSpec.__doc__ or "")
            out += ["", f"## {title}", "", doc, "", "| field | type | default | constraints | description |",
                    "|---|---|---|---|---|"]
        out.append(f"| `{row.path}` | {_cell(row.type)} | {_cell(row.default)} | {_cell(row.constraints)} | "
                   f"{_cell(row.description)} |")
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"
