"""User YAML and `--set` values that used to end in a traceback or a silent change: explicit tags on
text they cannot take, overrides through an alias, a list index out of range."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.spec.problems import SpecError
from orchestrator.spec.yaml_input import apply_overrides
from orchestrator.spec.yaml_loader import UniqueKeyLoader, yaml_reason


@pytest.mark.parametrize(("text", "words"), [
    ("lr: !!float abc", "line 1, column 5: float tag on 'abc'"),
    ("compile: !!bool maybe", "bool tag on 'maybe'"),
    ("name: !!timestamp x", "timestamp tag on 'x'"),
    ("faults: [{rank: !!float x}]", "float tag on 'x'"),
])
def test_an_explicit_tag_on_text_it_cannot_take_is_a_yaml_error_at_its_line(text, words):
    with pytest.raises(yaml.YAMLError) as caught:
        yaml.load(text, Loader=UniqueKeyLoader)
    assert words in yaml_reason(caught.value)


def test_such_a_tag_in_a_set_value_is_a_problem_naming_the_key():
    with pytest.raises(SpecError) as caught:
        apply_overrides({"train": {}}, ["train.compile=!!bool maybe"])
    [problem] = caught.value.problems
    assert problem.field == "train.compile" and "bool tag on 'maybe'" in problem.message


def test_an_override_through_an_alias_changes_only_the_place_it_names():
    data = yaml.load("checkpoint: {url: s3://b/c, storage_options: &s3 {endpoint_url: 'http://a:9000'}}\n"
                     "data: {path: s3://b/t, storage_options: *s3}\n", Loader=UniqueKeyLoader)
    out = apply_overrides(data, ["checkpoint.storage_options.endpoint_url=http://other:9000"])
    assert out["checkpoint"]["storage_options"] == {"endpoint_url": "http://other:9000"}
    assert out["data"]["storage_options"] == {"endpoint_url": "http://a:9000"}
    assert data["checkpoint"]["storage_options"] == {"endpoint_url": "http://a:9000"}  # the input untouched


def test_a_list_index_out_of_range_says_which_indices_there_are():
    with pytest.raises(SpecError) as caught:
        apply_overrides({"chaos": {"faults": [{"kind": "kill_rank"}]}}, ["chaos.faults.3.rank=1"])
    [problem] = caught.value.problems
    assert "use 0..0, or set the whole list, e.g. --set 'chaos.faults=[{...}]'" in problem.message
