"""Fuzz the job spec's path through the CLI (YAML file, `--set` overrides, validation): any input
gives a JobSpec or a SpecError whose problems each name a field on one line (printed, exit 2),
never another exception (a traceback)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.cli.exits import print_problems
from orchestrator.spec.job_spec import JobSpec, load_spec
from orchestrator.spec.problems import SpecError
from tests._fuzz import fuzz, json_values, mutated

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DOCUMENTS = [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))]
SECTIONS = ["name", "model", "data", "train", "parallel", "checkpoint", "elastic", "resources", "monitor",
            "chaos", "eval"]


def _load(text: str, overrides: list[str] = ()) -> JobSpec | None:
    """The spec path of `undying validate` and `run` up to the storage probe (which touches storage)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "job.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        try:
            return load_spec(path, overrides)
        except SpecError as err:
            assert err.problems
            for problem in err.problems:
                assert problem.field and problem.message and "\n" not in str(problem), problem
            print_problems(err.problems)
            return None


@fuzz(200)
@given(st.sampled_from(DOCUMENTS).flatmap(mutated))
def test_mutations_of_the_examples(document):
    _load(yaml.safe_dump(document))


@fuzz(100)
@given(st.dictionaries(st.sampled_from(SECTIONS) | st.text(max_size=6), json_values, max_size=6))
def test_random_mappings(document):
    _load(yaml.safe_dump(document))


@fuzz(60)
@given(st.text(max_size=80))
def test_random_text(text):
    _load(text)


@fuzz(100)
@given(st.lists(st.text(max_size=30) | st.builds("{}={}".format, st.sampled_from(SECTIONS + ["train.steps",
       "parallel.dp", "chaos.faults.0.rank", "checkpoint.storage_options"]), st.text(max_size=12)), max_size=3))
def test_random_overrides(overrides):
    _load(yaml.safe_dump(DOCUMENTS[0]), overrides)


@pytest.mark.parametrize("document", [
    {"\n": None},  # once printed as a field spanning two lines
    {**DOCUMENTS[0], "model": {"from_hf": 1}},  # once an AttributeError (int.rstrip) from the config reader
])
def test_inputs_the_fuzzer_found(document):
    assert _load(yaml.safe_dump(document)) is None
