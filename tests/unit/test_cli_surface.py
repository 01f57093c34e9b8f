"""What a script or a newcomer meets first: `--version`, `--help` that imports no engine, `--json`
outputs that parse, and `validate --offline`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from orchestrator.cli.main import LAZY_COMMANDS, main
from tests._checkpoints import flip_bit, shard_of
from tests.unit.test_ckpt_cli import job  # noqa: F401  (the fixture: committed 10, 20, 30; unfinished 15, 35)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "examples", "tiny.yaml")
# Every command but `chaos`, whose module imports its experiment runner (torch, Ray) at the top.
HELP_COMMANDS = [[], ["run"], ["validate"], ["plan"], ["spec"], ["ckpt"], ["ckpt", "ls"], ["ckpt", "verify"],
                 ["ckpt", "export"], ["data"], ["data", "prepare"], ["eval"], ["report"], ["chaos"], ["stop-jobs"],
                 ["drain-node"], ["spot-watch"]]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_comes_from_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"undying {version('undying')}"


def test_help_of_every_command_imports_neither_torch_nor_ray():
    script = f"""
import sys
from orchestrator.cli.main import _parser
for argv in {HELP_COMMANDS!r}:
    try:
        _parser().parse_args(argv + ["--help"])
    except SystemExit as done:
        assert done.code == 0, argv
print(sorted(m for m in ("torch", "ray") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "undying ckpt verify" in result.stdout and "--json" in result.stdout


def test_the_help_listed_for_a_lazy_command_is_its_modules_own():
    class Recorder:
        def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
            self.name, self.help = name, kwargs.get("help")
            return argparse.ArgumentParser()

    for name, (text, module, function, _) in LAZY_COMMANDS.items():
        recorder = Recorder()
        getattr(importlib.import_module(module), function)(recorder)
        assert (recorder.name, recorder.help) == (name, text), "keep main.LAZY_COMMANDS' help equal to the module's"


def test_validate_json_when_valid_and_offline_says_the_storage_was_not_probed(capsys, tmp_path):
    unreachable = ["--set", "checkpoint.url=s3://no-such-bucket/x",
                   "--set", "checkpoint.storage_options={endpoint_url: 'http://127.0.0.1:9'}"]
    code, out, _ = _run(capsys, "validate", TINY, *unreachable, "--offline", "--json")
    result = json.loads(out)
    assert code == 0 and result["valid"] is True and result["ranks"] == 2
    assert result["storage_probe"] == "skipped (--offline)" and result["checkpoint_root"] == "s3://no-such-bucket/x/tiny"
    code, out, _ = _run(capsys, "validate", TINY, *unreachable, "--offline")
    assert code == 0 and "not probed (--offline)" in out
    # A URL no rank could share is refused without reaching any store.
    code, out, _ = _run(capsys, "validate", TINY, "--set", "checkpoint.url=memory://ckpt", "--offline", "--json")
    assert code == 2 and [p["field"] for p in json.loads(out)["problems"]] == ["checkpoint.url"]


def test_validate_json_probes_storage_without_offline_and_lists_problems(capsys, tmp_path):
    code, out, _ = _run(capsys, "validate", TINY, "--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--json",
                        "--set", "checkpoint.interval=500")
    result = json.loads(out)
    assert code == 0 and result["storage_probe"] == "ok" and "counts seconds" in result["notes"][0]
    code, out, err = _run(capsys, "validate", TINY, "--set", "parallel.tp=3", "--set", "checkpoint.asynch=true",
                          "--json")
    result = json.loads(out)
    assert code == 2 and result["valid"] is False and err == ""
    assert {p["field"] for p in result["problems"]} == {"parallel.tp", "checkpoint.asynch"}


def test_validate_says_how_many_epochs_of_each_dataset_the_run_reads(capsys, tmp_path):
    import numpy as np

    from tests._tokens import write_token_dataset

    for name, n in (("a", 3400), ("b", 1700)):  # 200 and 100 windows of 17 tokens
        write_token_dataset(tmp_path / name, np.arange(n) % 200, 256)
    parts = f"[{{path: {tmp_path}/a, weight: 3}}, {{path: {tmp_path}/b, weight: 1}}]"
    mixture = f"{{source: tokens, seq_len: 16, mixture: {parts}}}"
    code, out, _ = _run(capsys, "validate", TINY, "--set", f"checkpoint.url=file://{tmp_path}/ckpt", "--set",
                        f"data={mixture}", "--set", "train.steps=100", "--set", "train.global_batch=8", "--json")
    notes = json.loads(out)["notes"]
    assert code == 0 and notes == [  # 800 samples: 600 of a's 200 windows, 200 of b's 100
        "data.mixture[0].path: 200 windows of data.seq_len + 1 = 17 tokens; train.steps = 100 read 3 epochs of it",
        "data.mixture[1].path: 100 windows of data.seq_len + 1 = 17 tokens; train.steps = 100 read 2 epochs of it"]


def test_ckpt_ls_json(capsys, job):  # noqa: F811
    url, _ = job
    code, out, _ = _run(capsys, "ckpt", "ls", url, "--json")
    listing = json.loads(out)
    assert code == 0 and listing["url"] == url
    assert [c["step"] for c in listing["committed"]] == [10, 20, 30]
    assert (listing["unfinished"], listing["in_progress"]) == ([15], [35])
    assert all(c["bytes"] > 0 and c["tensors"] > 0 for c in listing["committed"])
    assert listing["owner"] is None  # no driver ever claimed the folder


def test_ckpt_verify_json_reports_each_checkpoint_and_the_damage(capsys, job):  # noqa: F811
    url, catalog = job
    code, out, _ = _run(capsys, "ckpt", "verify", url, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] is True
    assert [(c["step"], c["status"]) for c in result["checkpoints"]] == [(10, "ok"), (20, "ok"), (30, "ok")]
    flip_bit(catalog, 20, shard_of(catalog, 20, "model/w"))
    code, out, err = _run(capsys, "ckpt", "verify", url, "--json")
    result = json.loads(out)
    assert code == 1 and result["ok"] is False and err == ""
    assert [c["status"] for c in result["checkpoints"]] == ["ok", "corrupt", "ok"]


def test_ckpt_json_errors_are_json_too(capsys, tmp_path):
    code, out, err = _run(capsys, "ckpt", "ls", str(tmp_path / "missing"), "--json")
    assert code == 2 and err == ""
    failure = json.loads(out)
    assert failure["exit"] == 2 and "does not exist" in failure["error"]


def test_a_reader_that_goes_away_ends_the_command_quietly(monkeypatch, tmp_path):
    # `undying ckpt verify URL | head -1`: the next line's write finds the pipe closed.
    import io
    import sys

    from orchestrator.cli.main import main

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return sink.fileno()

    with open(tmp_path / "sink", "w") as sink:
        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        assert main(["spec", "--markdown"]) == 1


@pytest.mark.parametrize("argv", [["ckpt", "gc", "file:///nowhere/job", "--f"],
                                  ["ckpt", "ls", "file:///nowhere/job", "--storage-options", "a=b"]])
def test_a_prefix_of_a_long_option_is_not_taken_for_it(capsys, argv):
    from orchestrator.cli.main import main

    with pytest.raises(SystemExit) as stop:  # argparse's own usage error
        main(argv)
    assert stop.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
