"""The README's shell commands, and how each one is checked, so the README cannot rot.

`readme_commands()` reads every fenced `bash` block of README.md (continuation lines joined,
comments dropped, spaces normalised). Every command must be in exactly one of three tables:

- FAST: run by tests/unit/test_readme_commands.py (default suite), in a scratch directory.
- END_TO_END: run in README order by tests/ray/test_readme_commands.py (heavy: it trains).
- COVERED: needs what a README line cannot reach from a test (a Ray head on the default port,
  an S3 bucket, the whole suite); the named test runs the same thing, and the table says what
  that test must contain.

A command added to or edited in the README is in no table, and the unit test fails until it is
classified. Both runners use a scratch directory holding `job.yaml` (examples/tiny.yaml with its
checkpoint URL moved into the scratch directory), symbolic links to the repository's `.venv`,
`Makefile` and `examples/finetune`, and an old copy of `pyproject.toml` (so `make` never reinstalls),
so `$PWD`-relative paths and `make` targets behave as in a checkout; `examples/*.yaml` are copies whose checkpoint URLs
point into the scratch directory instead of the shared /tmp/undying.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Expect:
    """What a command must do: its exit status and text its output must contain."""

    returncode: int = 0
    says: tuple[str, ...] = ()


FAST: dict[str, Expect] = {
    ".venv/bin/undying --version": Expect(says=("undying ",)),
    ".venv/bin/undying spec --schema | .venv/bin/python -m json.tool": Expect(says=('"properties"',)),
    ".venv/bin/undying validate job.yaml": Expect(says=("job.yaml: valid",)),
    ".venv/bin/undying validate job.yaml --offline --json": Expect(says=('"valid": true',)),
}

DEMO_CKPT = "file://$PWD/runs/demo/ckpt/demo"
FT = "$PWD/runs/finetune"
END_TO_END: dict[str, Expect] = {
    "make demo": Expect(says=("RUNNING -> SUCCEEDED",)),
    "make finetune": Expect(),
    ".venv/bin/undying chaos examples/demo.yaml --mtbf 30s --kind kill_rank --seed 1": Expect(says=("passed",)),
    ".venv/bin/undying chaos sweep examples/demo.yaml --mtbf 60s --kind kill_rank --intervals 5s,10s,20s,young "
    "--plot sweep.png": Expect(says=("young",)),
    f".venv/bin/undying ckpt ls {DEMO_CKPT}": Expect(says=("60",)),
    f".venv/bin/undying ckpt verify {DEMO_CKPT}": Expect(),
    f".venv/bin/undying ckpt export {DEMO_CKPT} --out model.safetensors": Expect(),
    f".venv/bin/undying ckpt gc {DEMO_CKPT} --keep 2": Expect(),
    f".venv/bin/undying report {DEMO_CKPT} --json --no-timeline": Expect(says=('"status": "succeeded"',)),
    # A second preparation over the first one's output is refused (its inputs were made anew), so the
    # pasted path starts over as `make finetune` does.
    "rm -rf runs/finetune": Expect(),
    ".venv/bin/python examples/finetune/make_assets.py runs/finetune": Expect(),
    f".venv/bin/undying data prepare runs/finetune/corpus/train-*.jsonl --tokenizer runs/finetune/tokenizer "
    f"--out file://{FT}/tokens/train": Expect(),
    f".venv/bin/undying data prepare runs/finetune/corpus/val.txt --tokenizer runs/finetune/tokenizer "
    f"--out file://{FT}/tokens/val": Expect(),
    f".venv/bin/undying run examples/finetune.yaml --set model.from_hf={FT}/pretrained "
    f"--set data.path=file://{FT}/tokens/train --set eval.path=file://{FT}/tokens/val "
    f"--set checkpoint.url=file://{FT}/ckpt": Expect(says=("kill_rank",)),
    f".venv/bin/undying eval file://{FT}/ckpt/finetune --data file://{FT}/tokens/val --json": Expect(says=('"loss"',)),
    f".venv/bin/undying ckpt export file://{FT}/ckpt/finetune --format hf --out runs/finetune/exported": Expect(),
    '.venv/bin/python examples/finetune/generate.py runs/finetune/exported "three plus four is"': Expect(),
    ".venv/bin/undying run job.yaml --report report.json": Expect(says=("SUCCEEDED",)),
    # After the run above the root holds committed checkpoints, so --fresh is refused, as documented.
    ".venv/bin/undying run job.yaml --fresh": Expect(returncode=2, says=("--fresh",)),
}

COVERED: dict[str, tuple[str, str]] = {
    "make test": (".ci/run", "make test"),
    ".venv/bin/undying data prepare corpus/*.jsonl books.parquet hf_dataset_dir --tokenizer tokenizer_dir "
    "--out s3://bucket/tokens/v1 --storage-option endpoint_url=http://...": (
        "tests/s3/test_data_s3.py", "test_prepare_to_s3_and_read_back"),
    ".venv/bin/undying run job.yaml --set parallel.dp=8 --set checkpoint.url=s3://bucket/ckpt": (
        "tests/ray/test_s3_job.py", 'f"checkpoint.url={url}"'),
    "source .venv/bin/activate": ("tests/ray/conftest.py", '"PATH": f"{VENV_BIN}:'),
    "ray start --head --dashboard-host 127.0.0.1": ("tests/ray/conftest.py", "--head"),
    "ray job submit --address http://127.0.0.1:8265 --working-dir . -- undying run examples/tiny.yaml": (
        "tests/ray/test_job_submit.py", '"job", "submit"'),
    "ray job submit --working-dir . --runtime-env-json '{\"env_vars\": {\"RAY_JOB_STOP_WAIT_TIME_S\": \"45\"}}' "
    "-- undying run job.yaml": (
        "tests/ray/test_preemption.py", "RAY_JOB_STOP_WAIT_TIME_S"),
    "ray job stop <submission id>": ("tests/ray/test_preemption.py", '"stop"'),
}


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (after a blank, outside quotes)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the README's ```bash blocks, in order."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(_strip_comment(line).split())
            if command:
                commands.append(command)
    return commands


def scratch(where: Path) -> Path:
    """A directory that behaves like a checkout for the README's commands (see the module doc)."""
    where.mkdir(parents=True, exist_ok=True)
    for name in (".venv", "Makefile"):
        (where / name).symlink_to(ROOT / name)
    # An old pyproject.toml: `make` there must never reinstall (an editable install from the scratch
    # directory would point the package at it); the tests run in the environment they are given.
    (where / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    os.utime(where / "pyproject.toml", (0, 0))
    examples = where / "examples"
    examples.mkdir()
    (examples / "finetune").symlink_to(ROOT / "examples" / "finetune")
    ckpt = f"file://{where}/ckpt"
    for spec in (ROOT / "examples").glob("*.yaml"):
        (examples / spec.name).write_text(spec.read_text().replace("file:///tmp/undying/ckpt", ckpt))
    (where / "job.yaml").write_text((examples / "tiny.yaml").read_text())
    return where


def run_command(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run one README command as a user's shell would, in `cwd` (a `scratch` directory)."""
    env = {**os.environ, "PWD": str(cwd)}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def check(command: str, proc: subprocess.CompletedProcess, expect: Expect) -> None:
    """Fail with the command's output tail unless it did what `expect` says."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == expect.returncode, f"{command}\nexit {proc.returncode}\n{output[-4000:]}"
    for text in expect.says:
        assert text in output, f"{command}: {text!r} not in its output\n{output[-4000:]}"

