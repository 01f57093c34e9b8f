"""The job spec's reference cannot drift from the code: docs/spec.md is regenerated and compared,
every field has a description, the JSON Schema is valid and accepts the examples; and the spec's
own spellings a user meets there (interval units, YAML 1.2 numbers, quoted `--set` keys) work."""

from __future__ import annotations

import glob
import json
import os

import pytest
import yaml
from jsonschema import Draft202012Validator

from orchestrator.cli.main import cadence_notes, main
from orchestrator.spec.job_spec import load_spec, validate_spec
from orchestrator.spec.problems import SpecError
from orchestrator.spec.reference import REGENERATE, markdown, rows, type_text, undocumented
from orchestrator.spec.yaml_input import apply_overrides
from orchestrator.spec.yaml_loader import UniqueKeyLoader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIMAL = {"name": "t", "model": {"preset": "tiny"}, "train": {"steps": 4, "global_batch": 2},
           "checkpoint": {"url": "file:///tmp/undying-spec-reference"}}


def _spec(**checkpoint):
    return validate_spec({**MINIMAL, "checkpoint": {**MINIMAL["checkpoint"], **checkpoint}})


def test_docs_spec_md_is_what_the_models_generate():
    with open(os.path.join(ROOT, "docs", "spec.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == markdown(), f"docs/spec.md is stale: regenerate it with `{REGENERATE}`"


def test_every_field_has_a_description():
    assert undocumented() == [], "give these fields a Field(description=...) (sections: a class docstring)"


def test_the_reference_lists_every_field_by_its_yaml_path():
    paths = {row.path for _, row in rows()}
    assert {"name", "checkpoint.async", "checkpoint.memory.interval", "chaos.faults[].kind",
            "data.mixture[].weight", "model.rope_scaling.factor"} <= paths
    assert "checkpoint.async_" not in paths
    interval = next(row for _, row in rows() if row.path == "checkpoint.interval")
    assert "SECONDS" in interval.description and "steps" in interval.description
    assert type_text(int | None) == "integer or null"


def test_spec_schema_is_json_schema_that_takes_the_examples_and_refuses_bad_yaml(capsys):
    assert main(["spec", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    Draft202012Validator.check_schema(schema)
    assert "async" in schema["$defs"]["CheckpointConfig"]["properties"]
    validator = Draft202012Validator(schema)
    for path in glob.glob(os.path.join(ROOT, "examples", "*.yaml")):
        with open(path, encoding="utf-8") as f:
            errors = list(validator.iter_errors(yaml.load(f, Loader=UniqueKeyLoader)))
        assert (errors != []) == path.endswith("bad.yaml"), (path, [e.message for e in errors])
    spelled = {**MINIMAL, "checkpoint": {"url": "s3://b/p", "interval": "500 steps"}, "chaos": {"mtbf_s": "30s"}}
    assert list(validator.iter_errors(spelled)) == []
    assert list(validator.iter_errors({**spelled, "checkpoint": {"url": "s3://b/p", "interval": "often"}}))


def _keywords(node) -> set[str]:
    """Every keyword used in a schema: the keys of each schema object, not of `properties`,
    `$defs` (names) or `default` (data)."""
    if isinstance(node, list):
        return set().union(*map(_keywords, node))
    if not isinstance(node, dict):
        return set()
    found = set(node)
    for key, value in node.items():
        if key in ("properties", "$defs"):
            found |= set().union(*map(_keywords, value.values()))
        elif key != "default":
            found |= _keywords(value)
    return found


def test_spec_schema_uses_only_json_schema_keywords(capsys):
    # pydantic copies a Field bound it cannot place into a replaced schema as "gt" or "ge", which
    # JSON Schema ignores: an editor would accept `mtbf_s: 0`.
    assert main(["spec", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    known = set(Draft202012Validator.VALIDATORS) | {"$schema", "$defs", "title", "description", "default"}
    assert _keywords(schema) - known == set()
    mtbf = schema["$defs"]["ChaosConfig"]["properties"]["mtbf_s"]
    assert list(Draft202012Validator(mtbf).iter_errors(0)) and not list(Draft202012Validator(mtbf).iter_errors("5s"))


def test_spec_markdown_prints_the_reference(capsys):
    assert main(["spec", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown()


@pytest.mark.parametrize("written, rule, every_steps, every_seconds", [
    ("500 steps", "steps", 500, None), ("1 step", "steps", 1, None), ("90s", "seconds", None, 90.0),
    ("10m", "seconds", None, 600.0), ("young", "young", None, None)])
def test_interval_accepts_the_unit_spelled_out(written, rule, every_steps, every_seconds):
    checkpoint = _spec(interval=written).checkpoint
    assert (checkpoint.rule, checkpoint.every_steps, checkpoint.every_seconds) == (rule, every_steps, every_seconds)
    assert cadence_notes(_spec(interval=written)) == []


def test_a_bare_number_interval_is_seconds_and_the_note_says_how_to_write_steps():
    spec = _spec(interval=500)
    assert (spec.checkpoint.rule, spec.checkpoint.fixed_seconds) == ("seconds", 500.0)
    (note,) = cadence_notes(spec)
    assert "counts seconds" in note and "interval: 500 steps" in note and "every_steps: 500" in note
    (note,) = cadence_notes(_spec(interval=0.5))  # half a second: no step count was meant, none suggested
    assert "counts seconds" in note and "every_steps" not in note


@pytest.mark.parametrize("checkpoint, fragment", [
    ({"interval": "500 stepz"}, "the unit spelled out: '500 steps', '90s'"),
    ({"interval": "0 steps"}, "must be positive"),
    ({"interval": "5 steps", "every_seconds": 3}, "both give the cadence; keep one"),
    ({"memory": {"interval": "0s"}}, "must be positive")])
def test_a_wrong_interval_says_how_to_write_it_and_names_the_field(checkpoint, fragment):
    with pytest.raises(SpecError) as err:
        _spec(**checkpoint)
    field = "checkpoint.memory.interval" if "memory" in checkpoint else "checkpoint.interval"
    assert [(p.field, fragment in p.message) for p in err.value.problems] == [(field, True)], err.value


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: t\nmodel: {preset: tiny}\ntrain: {steps: 40, global_batch: 2, lr: 1e-3}\n"
                    "checkpoint: {url: 'file:///tmp/undying-spec-reference', interval: 1e3}\n")
    spec = load_spec(str(path), ["train.warmup_steps=1e1", "checkpoint.mtbf_s=1.5e4"])
    assert (spec.train.lr, spec.checkpoint.interval, spec.train.warmup_steps) == (1e-3, 1000.0, 10)
    assert spec.checkpoint.mtbf_s == 15000.0
    assert yaml.load("a: 1e3x\nb: e3\nc: 12", Loader=UniqueKeyLoader) == {"a": "1e3x", "b": "e3", "c": 12}
    assert yaml.safe_load("a: 1e3") == {"a": "1e3"}  # PyYAML's own loader is left as it was


def test_set_addresses_keys_with_special_characters_when_quoted():
    data = apply_overrides({}, ['checkpoint.storage_options."client_kwargs:x"=1',
                                "data.storage_options.'a-b.c'.d=x=y", "parallel.dp = 2"])
    assert data == {"checkpoint": {"storage_options": {"client_kwargs:x": 1}},
                    "data": {"storage_options": {"a-b.c": {"d": "x=y"}}}, "parallel": {"dp": 2}}


@pytest.mark.parametrize("override, fragment", [
    ('checkpoint.storage_options."client_kwargs=1', "is never closed"),
    ("checkpoint.storage_options.client kwargs=1", "quote a key part"),
    ("parallel..dp=1", "quote a key part")])
def test_a_malformed_set_key_says_how_to_quote(override, fragment):
    with pytest.raises(SpecError) as err:
        apply_overrides({}, [override])
    (problem,) = err.value.problems
    assert problem.field == "--set" and fragment in problem.message


def test_a_quoted_key_is_named_quoted_in_errors():
    with pytest.raises(SpecError) as err:
        apply_overrides({"a": {"b:c": 1}}, ['a."b:c".d=2'])
    (problem,) = err.value.problems
    assert problem.field == "a.'b:c'.d" and "a.b:c is 1, not a section" in problem.message


def test_the_schema_and_the_reference_take_storage_options_file_as_the_loader_does(capsys, tmp_path):
    # The loader reads the key before validation, so no model has it; an editor must still accept it.
    assert main(["spec", "--schema"]) == 0
    validator = Draft202012Validator(json.loads(capsys.readouterr().out))
    (tmp_path / "s3.yaml").write_text("{key: k, secret: s}\n")
    section = {"url": "s3://bucket/ckpt", "storage_options": {"endpoint_url": "http://127.0.0.1:9"},
               "storage_options_file": "s3.yaml"}
    spec = {**MINIMAL, "checkpoint": section, "data": {"storage_options_file": "s3.yaml"},
            "eval": {"path": "s3://bucket/val.jsonl", "every_steps": 2, "storage_options_file": "s3.yaml"}}
    assert [e.message for e in validator.iter_errors(spec)] == []
    assert validate_spec(spec, str(tmp_path)).checkpoint.storage_options["secret"] == "s"
    assert list(validator.iter_errors({**spec, "checkpoint": {**section, "storage_options_file": 3}}))
    paths = {row.path for _, row in rows()}
    assert {"checkpoint.storage_options_file", "data.storage_options_file", "eval.storage_options_file"} <= paths
