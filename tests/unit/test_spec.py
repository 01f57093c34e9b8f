"""The job spec: loading, overrides, validation messages, hashing, and the storage probe."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem
from pydantic import ValidationError

from chaos.config import FaultSpec
from ckpt.config import CheckpointConfig
from orchestrator.spec.job_spec import (
    JobSpec,
    Problem,
    SpecError,
    apply_overrides,
    engine_support_problems,
    load_spec,
    spec_hash,
    validate_spec,
)
from orchestrator.spec.storage_check import check_storage, require_storage

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

# The job spec as the README shows it; it must load exactly as written.
TINY_YAML = """\
name: tiny
model: {preset: tiny}
data: {source: synthetic, seq_len: 64, seed: 0}
train: {steps: 60, global_batch: 16, micro_batch: 2, lr: 3.0e-4, optimizer: adamw, precision: fp32, seed: 0}
parallel: {dp: 2, tp: 1, pp: 1, zero: 0, schedule: 1f1b}
checkpoint: {url: "file:///tmp/undying/ckpt", interval: young, every_steps: null, keep: 3, async: true}
elastic: {min_dp: 1, spares: 0, max_restarts: 10}
resources: {cpus_per_rank: 1, gpus_per_rank: 0}
monitor: {port: 0}
chaos: {faults: [{kind: kill_rank, rank: 1, at_step: 25}]}
"""


@pytest.fixture
def tiny_data() -> dict:
    return yaml.safe_load(TINY_YAML)


def problems_of(data: dict, overrides: list[str] = ()) -> list[Problem]:
    with pytest.raises(SpecError) as caught:
        validate_spec(apply_overrides(data, overrides))
    return caught.value.problems


def fields_of(data: dict, overrides: list[str] = ()) -> list[str]:
    return [p.field for p in problems_of(data, overrides)]


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_readme_spec_loads_exactly_as_written(tmp_path):
    spec = load_spec(write(tmp_path, TINY_YAML))
    model = spec.model
    assert (spec.name, model.n_layers, model.n_heads, model.d_model) == ("tiny", 4, 4, 64)
    assert (spec.parallel.dp, spec.world_size, spec.train.lr) == (2, 2, 3.0e-4)
    assert spec.checkpoint.interval == "young" and spec.checkpoint.every_steps is None
    assert spec.checkpoint.async_ is True and spec.checkpoint.keep == 3
    assert spec.chaos.faults == [FaultSpec(kind="kill_rank", rank=1, at_step=25)]
    assert spec.checkpoint_root == "file:///tmp/undying/ckpt/tiny"
    assert load_spec(str(EXAMPLES / "tiny.yaml")) == spec
    changed = load_spec(str(EXAMPLES / "tiny.yaml"), ["parallel.dp=4", "chaos.faults=[]"])
    assert (changed.parallel.dp, changed.chaos.faults) == (4, [])


def test_demo_example_is_four_ranks_with_one_kill():
    spec = load_spec(str(EXAMPLES / "demo.yaml"))
    train, ckpt = spec.train, spec.checkpoint
    assert (spec.parallel.world_size, train.steps, train.global_batch, train.micro_batch) == (4, 60, 16, 2)
    assert (ckpt.url, ckpt.every_steps, ckpt.keep) == ("file:///tmp/undying/ckpt", 10, 3)
    assert spec.chaos.faults == [FaultSpec(kind="kill_rank", rank=1, at_step=25)]


def test_bad_example_reports_every_mistake_at_once():
    with pytest.raises(SpecError) as caught:
        load_spec(str(EXAMPLES / "bad.yaml"))
    fields = {p.field for p in caught.value.problems}
    assert {"name", "checkpoint.asynch", "parallel.tp", "train.global_batch", "resources.num_ranks",
            "chaos.faults[0].rank", "chaos.faults[0].at_step"} <= fields
    assert str(caught.value).splitlines() == [str(p) for p in caught.value.problems]


def test_unknown_top_level_key_lists_allowed_keys(tiny_data):
    [problem] = problems_of({**tiny_data, "foo": 1})
    assert problem.field == "foo"
    assert problem.message.startswith("unknown key 'foo'; allowed keys: name, model, data, train")


def test_unknown_nested_key_suggests_the_close_one(tiny_data):
    tiny_data["checkpoint"]["asynch"] = True
    [problem] = problems_of(tiny_data)
    assert problem.field == "checkpoint.asynch"
    assert "did you mean 'async'?" in problem.message
    assert "keep, max_failed_saves, async, writer, mtbf_s" in problem.message


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        (["parallel.tp=3"], "parallel.tp", "model.n_heads = 4 is not divisible by tp = 3; use a tp that "
                                           "divides heads, key/value heads, d_ff and vocab_size: 1, 2, 4"),
        (["parallel.pp=3", "parallel.schedule=interleaved"], "parallel.pp", "cannot cut 4 layers into 6 "
                                                                             "pipeline chunks"),
        (["resources.num_ranks=3"], "resources.num_ranks", "3 does not match parallel.dp * tp * pp = 2"),
        (["model.position=learned", "data.seq_len=512"], "data.seq_len", "exceeds model.max_seq_len = 256"),
        (["parallel.dp=1", "parallel.pp=2", "parallel.schedule=zero-bubble", "parallel.recompute=block"],
         "parallel.recompute", "'block' with schedule 'zero-bubble': torch 2.13's activation checkpointing"),
        (["parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true", "model.max_seq_len=255",
          "eval={path: v, every_steps: 5, seq_len: 255}"], "eval.seq_len", "is padded to 256 (a multiple of "
                                                                            "parallel.tp = 2"),
        (["data={source: text, path: a.txt}", "model.vocab_size=128"], "model.vocab_size", "at least 256"),
        (["data={source: text, path: a.txt}", "eval={path: v, every_steps: 5}"], "eval.path",
         "data.source 'text' trains on bytes as ids 0-255"),
        (["elastic.min_dp=3"], "elastic.min_dp", "3 exceeds parallel.dp = 2"),
        (["monitor.heartbeat_s=6"], "monitor.heartbeat_s", "over half the hang limit (10 s)"),
        (["monitor.heartbeat_s=7", "elastic.hang_timeout_s=12"], "monitor.heartbeat_s", "at most 6 s"),
        (["chaos.faults.0.rank=2"], "chaos.faults[0].rank", "use a rank in 0..1"),
        (["chaos.faults.0.at_step=60"], "chaos.faults[0].at_step", "use a step in 0..59"),
    ],
)
def test_cross_section_check(tiny_data, overrides, field, fragment):
    problems = [p for p in problems_of(tiny_data, overrides) if p.field == field]
    assert any(fragment in p.message for p in problems), problems


def test_global_batch_message_says_the_fix(tiny_data):
    [problem] = problems_of(tiny_data, ["parallel.dp=2", "train.global_batch=15"])
    assert str(problem) == ("train.global_batch: 15 is not divisible by parallel.dp * train.micro_batch = 4; "
                            "use a multiple of 4 such as 16")


def test_pipeline_layouts_the_engine_refuses_are_reported_on_their_field(tiny_data):
    # zero-bubble with ZeRO-3 computes wrong gradients in torch 2.13: refused before any rank starts.
    problems = problems_of(tiny_data, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
                                       "parallel.schedule=zero-bubble"])
    assert [p.field for p in problems] == ["parallel.schedule"]
    assert "parallel.zero=2" in problems[0].message
    [problem] = problems_of(tiny_data, ["parallel.schedule=pipedream"])
    assert problem.field == "parallel.schedule" and "PipeDream2BW" in problem.message
    assert engine_support_problems(validate_spec(apply_overrides(tiny_data, ["parallel.pp=2"]))) == []


@pytest.mark.parametrize("override", ["parallel.tp=2", "parallel.zero=1", "parallel.zero=3", "train.precision=fp16"])
def test_sharded_and_fp16_layouts_are_accepted(tiny_data, override):
    spec = validate_spec(apply_overrides(tiny_data, [override, "parallel.dp=2"]))
    assert engine_support_problems(spec) == []


def test_every_dimension_tp_splits_must_divide(tiny_data):
    problems = problems_of(tiny_data, ["parallel.tp=3", "model={vocab_size: 256, n_layers: 2, n_heads: 6, "
                                       "d_model: 48, d_ff: 100}"])
    messages = {p.message.split(" is ")[0] for p in problems if p.field == "parallel.tp"}
    assert messages == {"model.d_ff = 100", "model.vocab_size = 256"}


def test_section_and_cross_section_problems_come_together(tiny_data):
    fields = fields_of(tiny_data, ["train.stpes=3", "parallel.tp=3", "name=my job", "elastic.min_dp=5"])
    assert fields.count("parallel.tp") == 3  # 3 divides none of the heads, the MLP width, the vocabulary
    assert {"train.stpes", "name", "elastic.min_dp"} <= set(fields)


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        (["train.steps=sixty"], "train.steps", "valid integer"),
        (["train.lr=-1"], "train.lr", "greater than 0"),
        (["train.steps=1e9"], "train.steps", "less than 1000000000"),  # checkpoint directories hold 9 digits
        (["data.source=txt"], "data.source", "'synthetic', 'text' or 'tokens'; got 'txt'"),
        (["model=5"], "model", "expected a mapping"),
        (["chaos=null"], "chaos", "is empty; give the section's keys, or remove it to take the defaults"),
        (["train=null"], "train", "is empty; it is required: give steps, global_batch"),
        (["chaos.faults=[null]"], "chaos.faults[0]", "is empty; it is required: give kind"),
        (["resources.cpus_per_rank=0"], "resources.cpus_per_rank", "greater than 0"),
        (["resources.gpus_per_rank=-1"], "resources.gpus_per_rank", "greater than or equal to 0"),
        (["resources.gpus_per_rank=0.5"], "resources.gpus_per_rank", "two ranks would share one GPU"),
        (["resources.gpus_per_rank=8"], "resources.gpus_per_rank", "give 1 and raise parallel.dp, tp or pp"),
        (["data.path=corpus.txt"], "data.path", "is read only with source 'text'"),
        (["train.warmup_steps=500"], "train.warmup_steps", "500 exceeds train.steps 60: the learning rate would "
                                                           "never reach train.lr; lower it (e.g. 6"),
        (["elastic.hang_timeout_s=0"], "elastic.hang_timeout_s", "give a number of seconds > 0, or 'auto'"),
        (["elastic.restore_timeout_s=soon"], "elastic.restore_timeout_s", "is not a timeout"),
        (["elastic.hang_timeout_s=30", "elastic.collective_timeout_s=20"], "elastic.collective_timeout_s",
         "is not above elastic.hang_timeout_s=30"),
        (["resources.custom={accel: -1}"], "resources.custom.accel", "greater than or equal to 0"),
        (["monitor.port=70000"], "monitor.port", "less than or equal to 65535"),
        (["checkpoint.keep=0"], "checkpoint.keep", "greater than or equal to 1"),
        (["checkpoint.interval=often"], "checkpoint.interval", "expected 'young', 'young-daly' or a number of seconds"),
        (["checkpoint.interval=0"], "checkpoint.interval", "positive number of seconds"),
        (["model={n_layers: 2}"], "model", "give a preset"),
        (["parallel.virtual_stages=2"], "parallel.virtual_stages", "2 with parallel.pp 1: virtual stages are"),
        (["name=20240101"], "name", "got 20240101; quote it to give text"),
        (["name=true"], "name", "quote it to give text (YAML reads true and false as booleans)"),
        (["name=" + "a" * 300], "name", "300 characters; a job name is at most 128: shorten it"),
        (["name=a: b"], "name", "quote it to give text (YAML reads 'key: value' as a mapping)"),
        (["checkpoint.memory=false"], "checkpoint.memory", "got False; write {enabled: false}"),
        (["elastic.replace_timeout_s=2m"], "elastic.replace_timeout_s", "give seconds as a number, e.g. 600"),
        (["train.betas=[0.9]"], "train.betas[1]", "ends before item 1 (items count from 0); give all its items: Adam"),
    ],
)
def test_type_and_range_errors_name_the_field(tiny_data, overrides, field, fragment):
    [problem] = problems_of(tiny_data, overrides)
    assert problem.field == field and fragment in problem.message, problem


def test_missing_required_sections():
    problems = problems_of({"name": "x"})
    assert [p.field for p in problems] == ["model", "train", "checkpoint"]
    assert problems[0].message == "required key 'model' is missing; add it under the top level"


@pytest.mark.parametrize(
    ("fault", "field", "fragment"),
    [
        ({"kind": "kill_rank", "rank": 0}, "chaos.faults[0]", "give a trigger"),
        ({"kind": "kill_rank", "rank": 0, "at_step": 1, "at_seconds": 2.0}, "chaos.faults[0]",
         "at most one of at_step, at_seconds"),
        ({"kind": "kill_rank", "at_step": 1}, "chaos.faults[0].rank", "add rank"),
        ({"kind": "kill_controller", "rank": 0, "at_step": 1}, "chaos.faults[0].rank", "remove rank"),
        ({"kind": "slow_rank", "rank": 0, "at_step": 1}, "chaos.faults[0]", "needs factor"),
        ({"kind": "kill_node", "at_seconds": 5}, "chaos.faults[0]", "kill_node needs rank: <r>"),
        ({"kind": "storage_latency", "at_point": "ckpt.commit"}, "chaos.faults[0]", "needs delay_s"),
        ({"kind": "explode", "at_step": 1}, "chaos.faults[0].kind", "'kill_rank'"),
    ],
)
def test_fault_checks(tiny_data, fault, field, fragment):
    tiny_data["chaos"] = {"faults": [fault]}
    [problem] = problems_of(tiny_data)
    assert problem.field == field and fragment in problem.message, problem


@pytest.mark.parametrize(
    ("overrides", "fault", "field"),
    [
        ({}, {"kind": "kill_controller", "at_point": "after_manifest_commit", "at_step": "STEPS"}, None),
        ({}, {"kind": "kill_controller", "at_step": "STEPS"}, "chaos.faults[0].at_step"),
        ({}, {"kind": "kill_rank", "rank": 0, "at_point": "during_restore", "at_step": "STEPS"}, None),
        ({"dp": 2}, {"kind": "kill_rank", "rank": 0, "at_point": "in_allreduce"}, None),
        ({"dp": 1}, {"kind": "kill_rank", "rank": 0, "at_point": "in_allreduce"}, "chaos.faults[0].at_point"),
        ({"dp": 2, "zero": 3}, {"kind": "kill_rank", "rank": 0, "at_point": "in_allreduce"},
         "chaos.faults[0].at_point"),
    ],
)
def test_fault_points_that_need_the_layout_or_name_a_checkpoint(tiny_data, overrides, fault, field):
    """A point's at_step may be the final checkpoint's step; in_allreduce needs DDP's all-reduce."""
    tiny_data["parallel"].update(overrides)
    steps = tiny_data["train"]["steps"]
    tiny_data["chaos"] = {"faults": [{k: steps if v == "STEPS" else v for k, v in fault.items()}]}
    try:
        validate_spec(tiny_data)
        problems = []
    except SpecError as err:
        problems = err.problems
    assert [p.field for p in problems] == ([] if field is None else [field]), problems
    if field == "chaos.faults[0].at_point":
        assert "use dp > 1 with zero 0 or 1" in problems[0].message


def test_faults_that_need_no_rank():
    for fault in [dict(kind="kill_controller", at_step=10), dict(kind="kill_node", node="n2", at_step=3),
                  dict(kind="torn_write", at_point="ckpt.after_shards", repeat=True)]:
        assert FaultSpec.model_validate(fault).rank is None


def test_job_spec_built_in_python_is_checked_too(tiny_data):
    tiny_data["parallel"]["tp"] = 3
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(tiny_data)
    assert {e["loc"] for e in caught.value.errors()} == {("parallel", "tp")}


def test_checkpoint_url_normalisation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(url="ckpt/").url == f"file://{tmp_path}/ckpt"
    assert CheckpointConfig(url="/data/ckpt").url == "file:///data/ckpt"
    assert CheckpointConfig(url="s3://bucket/prefix/").url == "s3://bucket/prefix"
    assert CheckpointConfig(url="file:///").join("job") == "file:///job"
    with pytest.raises(ValidationError):
        CheckpointConfig(url="  ")
    for url in ("gs://bucket/ckpt", "abfs://container/ckpt", "hdfs://namenode/ckpt"):
        with pytest.raises(ValidationError, match=r"has no exclusive create .* use s3:// \(also for Google Cloud"):
            CheckpointConfig(url=url)


@pytest.mark.parametrize(("url", "words"), [
    ("file:/data/ckpt", "did you mean 'file:///data/ckpt'?"),
    ("s3:/bucket/ck", "did you mean 's3://bucket/ck'?"),
    ("file://data/ckpt", "file:// takes an absolute path"),
    ("s3://", "names no location; write one after 's3://', e.g. s3://bucket/prefix"),
    ("C:/data/ckpt", "is a Windows path"),
])
def test_a_url_mistyped_into_a_relative_path_is_refused(url, words, tmp_path, monkeypatch):
    # Taken as written, each would put the checkpoints in a folder under the working directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match=re.escape(words)):
        CheckpointConfig(url=url)
    assert list(tmp_path.iterdir()) == []


def test_memory_urls_are_refused_for_a_job_s_checkpoints():
    [problem] = check_storage("memory://ckpt", {})
    assert problem.field == "checkpoint.url" and "lives inside one process" in problem.message


def test_checkpoint_async_alias_and_options():
    by_alias = CheckpointConfig.model_validate({"url": "s3://b/p", "async": False, "interval": 600,
                                                "storage_options": {"endpoint_url": "http://minio:9000"}})
    assert by_alias == CheckpointConfig(url="s3://b/p", async_=False, interval=600.0,
                                        storage_options={"endpoint_url": "http://minio:9000"})
    assert by_alias.model_dump(by_alias=True)["async"] is False
    assert CheckpointConfig(url="/x", every_steps=10).mtbf_s == 3600.0


def test_presets_and_explicit_dimensions(tiny_data):
    small = validate_spec(apply_overrides(tiny_data, ["model={preset: small, d_ff: 1024}"])).model
    assert (small.n_layers, small.n_heads, small.d_model, small.d_ff) == (12, 12, 768, 1024)
    explicit = validate_spec(apply_overrides(
        tiny_data, ["model={vocab_size: 512, n_layers: 2, n_heads: 2, d_model: 32}"])).model
    assert (explicit.preset, explicit.n_layers, explicit.d_ff, explicit.head_dim) == (None, 2, 128, 16)


def test_override_values_are_parsed_as_yaml(tiny_data):
    spec = validate_spec(apply_overrides(tiny_data, [
        "parallel.dp=4", "checkpoint.url=s3://b/p", "chaos.faults=[]", "train.lr=1e-3",
        "checkpoint.every_steps=5", "elastic.spares=1", "resources={cpus_per_rank: 0.5, gpus_per_rank: 1}",
    ]))
    assert (spec.resources.cpus_per_rank, spec.resources.gpus_per_rank) == (0.5, 1)
    assert (spec.parallel.dp, spec.checkpoint.url, spec.chaos.faults) == (4, "s3://b/p", [])
    assert (spec.train.lr, spec.checkpoint.every_steps, spec.elastic.spares) == (1e-3, 5, 1)
    assert spec.checkpoint_root == "s3://b/p/tiny"


def test_override_creates_missing_sections_and_leaves_input_alone(tiny_data):
    del tiny_data["elastic"]
    data = apply_overrides(tiny_data, ["elastic.min_dp=2", "chaos.faults.0.rank=0"])
    assert data["elastic"] == {"min_dp": 2} and data["chaos"]["faults"][0]["rank"] == 0
    assert "elastic" not in tiny_data and tiny_data["chaos"]["faults"][0]["rank"] == 1


def test_malformed_overrides_name_themselves(tiny_data):
    bad = ["parallel.dp", "parallel.dp=[", "parallel.dp=", "chaos.faults.3.rank=1", "model.preset.x=1", "=3"]
    with pytest.raises(SpecError) as caught:
        apply_overrides(tiny_data, bad)
    problems = caught.value.problems
    assert all(repr(text) in p.message for text, p in zip(bad, problems, strict=True)), problems
    assert [p.field for p in problems] == ["--set", "parallel.dp", "parallel.dp", "chaos.faults.3.rank",
                                           "model.preset.x", "--set"]


def test_list_items_are_addressed_by_index_and_a_missing_list_says_to_set_it_whole(tiny_data):
    with pytest.raises(SpecError, match=r"write chaos\.faults\.0 for item 0, not chaos\.faults\[0\]"):
        apply_overrides(tiny_data, ["chaos.faults[0].rank=1"])
    data = {**tiny_data, "chaos": {}}
    with pytest.raises(SpecError, match=r"chaos\.faults is not in the spec, so it has no item 0: set the whole list"):
        apply_overrides(data, ["chaos.faults.0.rank=1"])
    assert apply_overrides(tiny_data, ["chaos.faults.0.rank=0"])["chaos"]["faults"][0]["rank"] == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: tiny\nmodel: {preset: tiny\n", "line 3, column 1"),
        ("- name: tiny\n", "the top level is a list, not a mapping"),
        ("", "the top level is empty"),
        ("name: a\nname: b\n", "key 'name' is given twice"),
    ],
)
def test_unreadable_files(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    [problem] = caught.value.problems
    assert problem.field == path and fragment in problem.message, problem


def test_yaml_merge_keys_fill_a_mapping_and_written_keys_override_them(tmp_path):
    # Anchors and `<<` merges, as specs with many similar faults write them; a key given twice is
    # still refused, but one a merge brings may be written over.
    faults = ("chaos:\n  faults:\n    - &kill {kind: kill_rank, rank: 1, at_step: 3}\n"
              "    - <<: *kill\n      rank: 0\n      at_step: 5\n")
    text = TINY_YAML.replace("chaos: {faults: [{kind: kill_rank, rank: 1, at_step: 25}]}\n", faults)
    spec = load_spec(write(tmp_path, text))
    assert [(f.kind, f.rank, f.at_step) for f in spec.chaos.faults] == [("kill_rank", 1, 3), ("kill_rank", 0, 5)]
    with pytest.raises(SpecError, match="key 'rank' is given twice"):
        load_spec(write(tmp_path, text.replace("      rank: 0\n", "      rank: 0\n      rank: 2\n")))


def test_plain_scalars_read_as_yaml_1_2_reads_them(tmp_path):
    # PyYAML's YAML 1.1 would train 8 steps for `steps: 010`, take a date for a name, false for `off`.
    text = TINY_YAML.replace("steps: 60", "steps: 060").replace("name: tiny", "name: 2024-06-01") \
        .replace("max_restarts: 10", "max_restarts: 0o12").replace("global_batch: 16", "global_batch: 1_6")
    spec = load_spec(write(tmp_path, text))
    read = (spec.train.steps, spec.name, spec.elastic.max_restarts, spec.train.global_batch)
    assert read == (60, "2024-06-01", 10, 16)
    wandb_off = text.replace("monitor: {port: 0}", "monitor: {port: 0, wandb: {mode: off}}")
    with pytest.raises(SpecError, match=r"monitor.wandb.mode: .*'online', 'offline' or 'disabled'; got 'off'"):
        load_spec(write(tmp_path, wandb_off))
    spec = load_spec(write(tmp_path, text), overrides=["checkpoint.async=no", "train.steps=1e2"])
    assert spec.checkpoint.async_ is False and spec.train.steps == 100  # (pydantic reads "no" as a bool)
    with pytest.raises(SpecError, match=r"train.steps: should be a valid integer.*got '0x_'"):
        load_spec(write(tmp_path, text), overrides=["train.steps=0x_"])  # a prefix without digits is text
    with pytest.raises(SpecError, match=r"'' is not an integer"):
        load_spec(write(tmp_path, text.replace("steps: 060", "steps: !!int ''")))


@pytest.mark.parametrize(("name", "fragment"), [("nope.yaml", "No such file"), ("", "Is a directory")])
def test_missing_file_and_directory(tmp_path, name, fragment):
    with pytest.raises(SpecError, match=f"^{re.escape(str(tmp_path / name))}: .*{fragment}"):
        load_spec(str(tmp_path / name))


def test_spec_hash_is_stable(tmp_path, tiny_data):
    spec = load_spec(str(EXAMPLES / "tiny.yaml"))
    digest = spec_hash(spec)
    assert len(digest) == 64 and digest == spec_hash(load_spec(write(tmp_path, TINY_YAML)))
    # Block style with keys in another order is the same spec.
    reordered = yaml.safe_dump(dict(reversed(list(tiny_data.items()))), default_flow_style=False)
    assert spec_hash(load_spec(write(tmp_path, reordered, "block.yaml"))) == digest
    # Its canonical JSON is itself a valid spec with the same hash.
    assert spec_hash(validate_spec(spec.model_dump(mode="json", by_alias=True))) == digest
    assert spec_hash(validate_spec(apply_overrides(tiny_data, ["train.seed=1"]))) != digest
    # User-given mappings hash by content, not by the order their keys were written in.
    one, two = (validate_spec(apply_overrides(tiny_data, [f"checkpoint.storage_options={o}"]))
                for o in ("{a: 1, b: 2}", "{b: 2, a: 1}"))
    assert spec_hash(one) == spec_hash(two)
    # ... and does not depend on the process (string hashing is randomised per process).
    code = f"from orchestrator.spec.job_spec import *; print(spec_hash(load_spec({str(EXAMPLES / 'tiny.yaml')!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONHASHSEED": "7"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest


def test_writable_local_directory_is_created_and_left_clean(tmp_path):
    target = tmp_path / "a" / "b"
    assert check_storage(str(target), {}) == []
    assert target.is_dir() and list(target.iterdir()) == []


@pytest.mark.parametrize(
    ("make_url", "fragment"),
    [
        (lambda tmp: "nosuchproto://x", "unknown or unavailable protocol"),
        (lambda tmp: f"file://{tmp}/afile/sub", "not a directory"),
        (lambda tmp: f"file://{tmp}/afile", "not a directory"),
        # sysfs refuses new directories even to root, so this is read-only for any user.
        (lambda tmp: "file:///sys/undying-probe", "writable location"),
    ],
)
def test_unusable_locations_are_reported(tmp_path, make_url, fragment):
    (tmp_path / "afile").write_text("x")
    [problem] = check_storage(make_url(tmp_path), {})
    assert problem.field == "checkpoint.url" and fragment in problem.message, problem


def test_unreachable_s3_endpoint_fails_in_seconds():
    from s3fs import S3FileSystem

    with socket.socket() as sock:  # a port nobody listens on once this socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cached = dict(S3FileSystem._cache)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"}
    started = time.monotonic()
    [problem] = check_storage("s3://bucket/prefix", options)
    assert time.monotonic() - started < 10
    assert problem.field == "checkpoint.url" and "endpoint" in problem.message
    assert dict(S3FileSystem._cache) == cached  # the probe's instance was not cached
    assert options == {"endpoint_url": options["endpoint_url"], "key": "k", "secret": "s"}


class _StuckFileSystem(MemoryFileSystem):
    protocol, store, pseudo_dirs = "undying-stuck", {}, [""]  # its own store, not memory://'s

    def pipe_file(self, path, value, **kwargs):
        time.sleep(10)  # like an endpoint that accepts the connection and then goes quiet


class _NoDeleteFileSystem(MemoryFileSystem):
    protocol, store, pseudo_dirs = "undying-nodelete", {}, [""]

    def rm_file(self, path):
        raise PermissionError(path)


def test_probe_gives_up_at_its_deadline():
    fsspec.register_implementation(_StuckFileSystem.protocol, _StuckFileSystem, clobber=True)
    started = time.monotonic()
    [problem] = check_storage("undying-stuck://b/p", {}, timeout_s=0.5)
    assert time.monotonic() - started < 5 and "did not answer within 0.5 s" in problem.message


def test_storage_that_cannot_delete_is_reported():
    fsspec.register_implementation(_NoDeleteFileSystem.protocol, _NoDeleteFileSystem, clobber=True)
    [problem] = check_storage("undying-nodelete://b/p", {})
    assert problem.field == "checkpoint.url" and "checkpoint.keep" in problem.message


def test_require_storage_raises_spec_error(tmp_path, tiny_data):
    (tmp_path / "afile").write_text("x")
    ok = validate_spec(apply_overrides(tiny_data, [f"checkpoint.url={tmp_path}/ckpt"]))
    require_storage(ok)
    bad = validate_spec(apply_overrides(tiny_data, [f"checkpoint.url={tmp_path}/afile"]))
    with pytest.raises(SpecError) as caught:
        require_storage(bad)
    assert [p.field for p in caught.value.problems] == ["checkpoint.url"]


@pytest.mark.parametrize("override, field", [
    ("train.steps=true", "train.steps"), ("parallel.dp=true", "parallel.dp"),
    ("checkpoint.keep=false", "checkpoint.keep"), ("elastic.min_dp=true", "elastic.min_dp"),
    ("train.lr=true", "train.lr"), ("monitor.port=true", "monitor.port"),
    ("chaos.faults=[{kind: kill_rank, rank: true, at_step: 3}]", "chaos.faults[0].rank"),
])
def test_a_yes_no_is_not_taken_for_a_number(override, field):
    # YAML reads `true` as a boolean, which pydantic alone would take as 1 (one step, one rank).
    with pytest.raises(SpecError) as caught:
        load_spec(str(EXAMPLES / "tiny.yaml"), [override])
    [problem] = caught.value.problems
    assert problem.field == field and "is a yes/no, not a number" in problem.message, problem


def test_yes_no_fields_still_take_yes_no_and_adam_betas_must_be_below_one():
    spec = load_spec(str(EXAMPLES / "tiny.yaml"), ["checkpoint.async=false", "train.deterministic=false"])
    assert spec.checkpoint.async_ is False and spec.train.deterministic is False
    with pytest.raises(SpecError, match=r"train\.betas.*must be in \[0, 1\)"):
        load_spec(str(EXAMPLES / "tiny.yaml"), ["train.betas=[0.9, 1.5]"])


@pytest.mark.parametrize("override", ["checkpoint.interval=.inf", "checkpoint.interval=.nan", "train.lr=.inf",
                                      "elastic.hang_timeout_s=.nan"])
def test_yaml_infinities_and_nans_are_not_numbers_a_spec_takes(override):
    with pytest.raises(SpecError) as caught:
        load_spec(str(EXAMPLES / "tiny.yaml"), [override])
    assert caught.value.problems[0].field == override.split("=")[0]



def test_a_spec_that_would_fail_at_placement_or_model_build_is_refused_by_field():
    from orchestrator.spec.job_spec import ResourcesConfig
    from trainer.config import ModelConfig

    with pytest.raises(ValidationError, match=r"custom\n.*GPU is not a custom resource; give it as "
                                              r"resources.cpus_per_rank or resources.gpus_per_rank"):
        ResourcesConfig(custom={"GPU": 1})
    assert ResourcesConfig(custom={"accelerator_type:H100": 1}).custom == {"accelerator_type:H100": 1}
    with pytest.raises(ValidationError, match=r"d_model / n_heads = 3 is odd: choose n_heads so that it is even, "
                                              r"or position: learned"):
        ModelConfig(vocab_size=256, n_layers=2, d_model=96, n_heads=32)
    assert ModelConfig(vocab_size=256, n_layers=2, d_model=96, n_heads=32, position="learned").head_dim == 3


def test_a_filesystem_without_exclusive_create_is_refused_before_any_commit_needs_one(tmp_path, monkeypatch):
    def no_links(src, dst):  # as a FUSE mount of an object store answers
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    [problem] = check_storage(str(tmp_path / "ck"), {})
    assert problem.field == "checkpoint.url" and "cannot create a file exclusively" in problem.message
    assert "FUSE mount" in problem.message and list((tmp_path / "ck").iterdir()) == []


def test_a_store_that_overwrites_on_an_exclusive_create_is_refused(tmp_path, monkeypatch):
    import ckpt.storage

    def overwrite(self, path, data):  # an S3-compatible store ignoring If-None-Match: * does this
        with open(path, "wb") as f:
            f.write(data)

    monkeypatch.setattr(ckpt.storage.Storage, "_create_exclusive_posix", overwrite)
    [problem] = check_storage(str(tmp_path / "ck"), {})
    assert problem.field == "checkpoint.url" and "could overwrite each other" in problem.message
    assert list((tmp_path / "ck").iterdir()) == []
