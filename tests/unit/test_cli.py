"""The CLI on bad input: exit code 2, one line per problem naming the field, no traceback,
and nothing started (these run without Ray)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cluster.capacity import capacity_problems
from orchestrator.spec.job_spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
UNDYING = str(Path(sys.executable).parent / "undying")


def _undying(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([UNDYING, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_bad_spec_exits_2_naming_every_field():
    proc = _undying("run", "examples/bad.yaml")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    for field in ("name", "parallel.tp", "train.global_batch", "checkpoint.asynch", "resources.num_ranks"):
        assert field in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.dp=3", "train.global_batch"),
        ("parallel.tp=3", "parallel.tp"),
        ("parallel.pp=9", "parallel.pp"),  # more stages than the layers can fill
        ("model.n_heads=3", "model"),
        ("resources.num_ranks=8", "resources.num_ranks"),
        ("typo_key=1", "typo_key"),
        ("checkpoint.url=nosuchproto://bucket/x", "checkpoint.url"),
        ("checkpoint.url=s3:bucket/x", "did you mean 's3://bucket/x'"),  # else a local folder named s3:bucket
        ("checkpoint.url=file:///proc/undying-cannot-write", "checkpoint.url"),
        ("chaos.faults=[{kind: kill_controller, at_seconds: 3}]", "chaos.faults[0].at_seconds"),
        ("chaos.faults=[{kind: kill_controller, at_point: after_backward}]", "chaos.faults[0].at_point"),
        ("chaos.faults=[{kind: corrupt_shard, at_point: during_stage}]", "chaos.faults[0].at_point"),
    ],
)
def test_each_bad_input_names_its_field(override, field):
    proc = _undying("run", "examples/demo.yaml", "--set", override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr


def test_validate_accepts_the_examples():
    for name in ("demo.yaml", "tiny.yaml"):
        proc = _undying("validate", f"examples/{name}")
        assert proc.returncode == 0, proc.stderr
        assert "valid" in proc.stdout


def test_missing_file_is_a_usage_error():
    proc = _undying("run", "examples/does-not-exist.yaml")
    assert proc.returncode == 2 and "does-not-exist.yaml" in proc.stderr


def test_capacity_problems_name_the_resource_field():
    spec = load_spec(str(ROOT / "examples/demo.yaml"), ["resources.gpus_per_rank=1"])
    problems = capacity_problems(spec, {"CPU": 2.0})
    assert [p.field for p in problems] == ["resources.cpus_per_rank", "resources.gpus_per_rank"]
    assert "4 ranks" in problems[0].message
    assert capacity_problems(spec, {"CPU": 8.0, "GPU": 4.0}) == []
